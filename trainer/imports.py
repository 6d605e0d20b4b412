"""Run a function right after a module is first imported, wherever the import happens.

:func:`after_import` is how the runner (:mod:`trainer.run`) reaches ``deepspeed.initialize`` and
``torch.distributed`` without importing either early. The hook stays in ``sys.meta_path`` until
the module has really executed: an availability probe (``importlib.util.find_spec``, which
transformers and accelerate run before they import DeepSpeed) asks for a spec but runs nothing,
and must not use the hook up.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Sequence
from types import ModuleType


def after_import(name: str, then: Callable[[ModuleType], None]) -> None:
    """Call ``then(module)`` once module ``name`` has executed: now when it is already imported,
    else right after its first import completes (before the importer sees it)."""
    module = sys.modules.get(name)
    if module is not None:
        then(module)
        return
    sys.meta_path.insert(0, _AfterImport(name, then))


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then
        self._looking = False  # our own find_spec below asks the other finders, not us

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name or self._looking:
            return None
        self._looking = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._looking = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Patching(spec.loader, self)
        return spec


class _Patching(importlib.abc.Loader):
    """The module's own loader, then the hook; the hook leaves ``sys.meta_path`` once it ran."""

    def __init__(self, loader: importlib.abc.Loader, hook: _AfterImport) -> None:
        self.loader = loader
        self.hook = hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        if self.hook in sys.meta_path:
            sys.meta_path.remove(self.hook)
        self.hook.then(module)

    def __getattr__(self, name: str) -> object:  # get_source, is_package, ... as the real loader
        return getattr(self.loader, name)
