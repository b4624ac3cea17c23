"""dspine: DSpine speculative-decoding drafters — train, adapt to agent workloads, serve losslessly.

One import name. The product's top-level folders `kernels/`, `workloads/`, `drafters/`, `agents/` and `adapt/` are
this package's subpackages `dspine.kernels`, `dspine.workloads`, `dspine.drafters`, `dspine.agents` and
`dspine.adapt`: an install maps them (pyproject `package-dir`); a source checkout run without installing
(`PYTHONPATH=.`, as on the GPU machine) maps them here, through a finder that only answers for those names and
only when the folder is there.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

SIBLINGS = ("kernels", "workloads", "drafters", "agents", "adapt")


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    root = Path(__file__).resolve().parent.parent

    def find_spec(self, fullname, path=None, target=None):
        head, _, name = fullname.partition(".")
        if head != __name__ or name not in SIBLINGS:
            return None
        init = self.root / name / "__init__.py"
        if not init.is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(init.parent)])


if not any(isinstance(f, _SourceTreeFinder) for f in sys.meta_path):
    sys.meta_path.append(_SourceTreeFinder())  # after the regular finders: an installed subpackage wins
