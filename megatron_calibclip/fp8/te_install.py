"""Was the installed Transformer Engine built for the running torch and CUDA?

Why: TE's PyTorch extension (`transformer_engine_torch`) ships as a source distribution only
(no wheel of any release on PyPI). Under pip's build isolation it is compiled against the
`torch>=2.1` its pyproject names, i.e. the newest torch on the index, not the pinned one, and
then fails to load beside ours ("undefined symbol"); megatron-core imports TE inside
try/except, so without a check a run would quietly lose TE. The extension's own metadata
requires `transformer_engine_cu<major>` for the CUDA major of the torch it was built against
(its setup.py), so a core library for another CUDA than torch's is visible without loading
anything. `calibclip info` prints `describe()`; a TE run refuses `install_problem()` in one
line (trainer/te_run.py).
"""
from __future__ import annotations

import importlib
import importlib.metadata as metadata
import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# the distributions a TE install consists of (PyPI names, as importlib.metadata spells them)
TE_DISTRIBUTIONS: tuple[str, ...] = ("transformer_engine", "transformer_engine_torch",
                                     "transformer_engine_cu12", "transformer_engine_cu13")
# one per tested line (docs/versions.md): megatron-core 0.16.1 admits TE < 2.12 (2.11.0 is the
# newest it admits); 2.18.0 is the release the 0.19 line was read against (docs/gpu.md)
TESTED_TE: dict[str, str] = {"0.16": "2.11.0", "0.19": "2.18.0"}
INSTALL_LINE = 'pip install --no-build-isolation "transformer-engine[pytorch]==<version>"'


@dataclass(frozen=True)
class TeInstall:
    """What is installed, read without importing TE (except `import_error`)."""
    versions: dict[str, str]  # TE distribution -> version, for those installed
    extension_core: Optional[str]  # the core the extension requires, e.g. "transformer_engine_cu12"
    torch_version: str
    torch_cuda: Optional[str]  # torch.version.cuda (None: a CPU build of torch)
    import_error: Optional[str]  # `import transformer_engine.pytorch` failed with this; None: loaded

    @property
    def installed(self) -> bool:
        return bool(self.versions)


def _installed_versions() -> dict[str, str]:
    found = {}
    for name in TE_DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def _extension_core() -> Optional[str]:
    try:
        requires = metadata.requires("transformer_engine_torch") or []
    except metadata.PackageNotFoundError:
        return None
    for req in requires:
        m = re.match(r"\s*(transformer[-_]engine[-_]cu\d+)", req)
        if m:
            return m.group(1).replace("-", "_")
    return None


def _import_error(importer: Callable[[str], object]) -> Optional[str]:
    try:
        importer("transformer_engine.pytorch")
    except Exception as err:  # noqa: BLE001 - ImportError, OSError (a missing .so), AssertionError
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None


def read_install(importer: Callable[[str], object] = importlib.import_module) -> TeInstall:
    """This process's TE install (TE is imported only when its distributions are present)."""
    versions = _installed_versions()
    return TeInstall(versions=versions, extension_core=_extension_core(),
                     torch_version=torch.__version__, torch_cuda=torch.version.cuda,
                     import_error=_import_error(importer) if versions else None)


def _cuda_major(core: str) -> int:
    return int(core.rsplit("cu", 1)[1])


def problems(install: TeInstall) -> list[str]:
    """Why this TE install cannot run with this torch (empty: it can, or TE is absent)."""
    if not install.installed:
        return []
    found: list[str] = []
    if install.torch_cuda is None:
        found.append(f"torch {install.torch_version} is a CPU build; TE needs torch's CUDA build")
    if len(set(install.versions.values())) > 1:
        found.append("TE's distributions differ in version ("
                     + ", ".join(f"{k} {v}" for k, v in sorted(install.versions.items())) + ")")
    if "transformer_engine_torch" not in install.versions and install.import_error:
        # a source build (NGC's containers) puts the extension inside the one distribution
        # `transformer_engine`: missing only when it does not load either
        found.append(f"transformer_engine_torch (TE's PyTorch extension) is not installed "
                     f"({install.import_error})")
    torch_major = int(install.torch_cuda.split(".")[0]) if install.torch_cuda else None
    if torch_major is not None:
        cores = [n for n in install.versions if re.fullmatch(r"transformer_engine_cu\d+", n)]
        if install.extension_core and _cuda_major(install.extension_core) != torch_major:
            found.append(f"the extension was built against a torch with CUDA "
                         f"{_cuda_major(install.extension_core)} (it requires "
                         f"{install.extension_core}); this torch has CUDA {install.torch_cuda}")
        elif cores and all(_cuda_major(c) != torch_major for c in cores):
            found.append(f"TE's core library is built for CUDA {_cuda_major(cores[0])}; "
                         f"this torch has CUDA {install.torch_cuda}")
    if install.import_error and not found:
        why = install.import_error
        if "undefined symbol" in why:
            why = (f"its extension was built against another torch than {install.torch_version} "
                   f"({why[:160]})")
        found.append(f"import transformer_engine.pytorch fails: {why}")
    return found


def _tested_te_version() -> str:
    from megatron_calibclip import compat

    version = compat.megatron_version()
    line = ".".join(version.split(".")[:2])
    return TESTED_TE.get(line, TESTED_TE["0.19"])


def install_problem(install: Optional[TeInstall] = None) -> Optional[str]:
    """One line for a TE install that does not fit the running torch, or None."""
    install = install if install is not None else read_install()
    found = problems(install)
    if not found:
        return None
    return (f"transformer-engine does not fit torch {install.torch_version} (CUDA "
            f"{install.torch_cuda or 'none'}): {'; '.join(found)}; reinstall it with "
            f"`{INSTALL_LINE.replace('<version>', _tested_te_version())}` (docs/cluster.md)")


def describe(install: Optional[TeInstall] = None) -> str:
    """The `calibclip info` line."""
    install = install if install is not None else read_install()
    if not install.installed:
        return "not installed"
    parts = ", ".join(f"{k} {v}" for k, v in sorted(install.versions.items()))
    problem = install_problem(install)
    if problem is None:
        return f"{parts}; built for this torch {install.torch_version} (CUDA {install.torch_cuda})"
    return f"{parts}; DOES NOT FIT: {problem}"
