"""Evaluators, declared in the config and run alike inside a training run (pipeline/train/evaluations.py
makes each a periodic task) and by `vitp eval` on a checkpoint (pipeline/evaluate.py), as big_vision
declares ``config.evals``::

    evals:
      - name: pets            # names its metrics and its checkpointed progress
        type: fewshot         # a module of this package (classify, fewshot, linear_probe), or
                              # package.module:Class
        data: s3://b/pets     # a `vitp prep` output at any address vitp reads (default: data.path)
        train_split: train    # the split keys its type reads (classify: split)
        test_split: test
        every: 1000           # steps between runs inside a training run; 0: only at the end
        prefix: fewshot/      # default: the type's
        shots: [1, 5, 10]     # the type's own options (its ``Options`` section)

A type is a subclass of :class:`Evaluator`: its ``splits`` (the entry keys it needs), its ``Options``
(a config section of its own keys), ``after_checkpoint`` (inside a run: whether it runs once the
step's checkpoint is saved, remembering the steps it did) and ``run(model, step) -> metrics``
(collective; the metrics on rank 0). A new type is one module here that sets ``EVALUATOR = Class``,
or any importable class named as ``package.module:Class``.

The older keys stay as shorthand for entries (pipeline/eval/declared.py: ``run_entries``,
``eval_entries``): ``train.eval_every`` is a classify entry "val" on data.val_split with prefix ``val_``;
``eval.fewshot_data`` + ``train.fewshot_every`` are fewshot entries with prefix ``fewshot/``; `vitp
eval`'s flags are entries on ``eval.split`` (``--evals FILE`` replaces them).
"""

from pipeline.eval.declared import (  # the machinery: pipeline/eval/declared.py
    Context,
    Declared,
    Evaluator,
    NoOptions,
    Results,
    check_data,
    declare,
    eval_entries,
    flag_entries,
    prelogits,
    run_all,
    run_entries,
    score_model,
    type_of,
)

__all__ = ["Context", "Declared", "Evaluator", "NoOptions", "Results", "check_data", "declare", "eval_entries",
           "flag_entries", "prelogits", "run_all", "run_entries", "score_model", "type_of"]
