"""`make gpu-check GPU_CHECK_SMOKE=1` only (bench/gpu_check.py puts this folder first on PYTHONPATH): every
process of the smoke sees only what the GPU machine will have, the image's packages (packages.txt here)
and the carried wheels. An import of a module outside both (VITP_IMAGE_DENY, computed by the check) fails
as it would there, so a wheel missing from `make gpu-wheels` shows on the CPU, not on the GPU's clock.
"""

import os
import sys

_DENY = frozenset(filter(None, os.environ.get("VITP_IMAGE_DENY", "").split(",")))


class _NotInImage:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in _DENY:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the GPU image, nor among the wheels of "
                                      "`make gpu-wheels`)", name=name)
        return None


if _DENY:
    sys.meta_path.insert(0, _NotInImage)
