"""Issue 37 finding 4: a Transformer Engine built for another torch or CUDA is named in one line.

The installs are real distribution metadata (dist-info folders on sys.path, read by
importlib.metadata as pip's would be), shaped as TE's own packaging writes them: the meta
package `transformer_engine`, the core `transformer_engine_cu<major>` and the extension
`transformer_engine_torch`, whose Requires-Dist names the core for the CUDA major of the torch
it was compiled against (its setup.py). What pip's build isolation leaves behind, an extension
linked against another libtorch, shows up only when it is loaded: the importer stands in for
that load with the dynamic linker's message.
"""
import pytest
import torch

from megatron_calibclip.fp8 import te_install
from megatron_calibclip.fp8.te_install import describe, install_problem, read_install

pytestmark = pytest.mark.te_stand_in

UNDEFINED = ("transformer_engine_torch.cpython-311-x86_64-linux-gnu.so: undefined symbol: "
             "_ZN3c1017RegisterOperatorsD1Ev")


def _dist(root, name, version, requires=()):
    info = root / f"{name}-{version}.dist-info"
    info.mkdir()
    lines = ["Metadata-Version: 2.4", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


@pytest.fixture
def te_installed(tmp_path, monkeypatch):
    """A TE 2.11.0 install whose extension was built against a torch with CUDA `built_cuda`."""
    def make(built_cuda=12, core=None, versions=None):
        versions = versions or {}
        core = core or f"transformer_engine_cu{built_cuda}"
        v = lambda n: versions.get(n, "2.11.0")  # noqa: E731
        _dist(tmp_path, "transformer_engine", v("transformer_engine"))
        _dist(tmp_path, core, v(core))
        _dist(tmp_path, "transformer_engine_torch", v("transformer_engine_torch"),
              ["torch>=2.1", "einops", f"transformer_engine_cu{built_cuda}=={v(core)}"])
        monkeypatch.syspath_prepend(str(tmp_path))
    return make


def _loads(name):
    return None


def _undefined_symbol(name):
    raise ImportError(UNDEFINED)


def test_te_install_absent_is_not_a_problem():
    install = read_install(importer=_undefined_symbol)
    if install.installed:
        pytest.skip("a real transformer-engine is installed here")
    assert install_problem(install) is None and describe(install) == "not installed"


def test_te_install_built_for_this_torch_passes(te_installed, monkeypatch):
    te_installed(built_cuda=12)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    install = read_install(importer=_loads)
    assert install.extension_core == "transformer_engine_cu12"
    assert install.versions == {n: "2.11.0" for n in ("transformer_engine",
                                "transformer_engine_torch", "transformer_engine_cu12")}
    assert install_problem(install) is None
    assert "built for this torch" in describe(install)


@pytest.mark.parametrize("case, torch_cuda, built_cuda, importer, versions, message", [
    ("isolated-build", "12.8", 12, _undefined_symbol, {},
     f"built against another torch than {torch.__version__}"),
    ("cuda-major", "13.0", 12, _loads, {}, "built against a torch with CUDA 12"),
    ("cpu-torch", None, 12, _loads, {}, "is a CPU build"),
    ("versions", "12.8", 12, _loads, {"transformer_engine": "2.18.0"}, "differ in version"),
])
def test_te_install_mismatch_is_one_line_naming_the_fix(te_installed, monkeypatch, case,
                                                        torch_cuda, built_cuda, importer,
                                                        versions, message):
    te_installed(built_cuda=built_cuda, versions=versions)
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    problem = install_problem(read_install(importer=importer))
    assert problem is not None and message in problem, problem
    assert "\n" not in problem
    assert "--no-build-isolation" in problem and "==2.1" in problem  # the tested release
    assert "DOES NOT FIT" in describe(read_install(importer=importer))


def test_te_install_mismatch_refuses_a_te_run(te_installed, monkeypatch):
    from megatron_calibclip.config import ConfigError
    from megatron_calibclip.fp8 import FP8Recipe
    from megatron_calibclip.trainer.te_run import check_te_run

    te_installed(built_cuda=12)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    broken = read_install(importer=_undefined_symbol)
    kwargs = dict(params_dtype="bf16", rollout_engine="vllm",
                  recipes_in_use=[("fp8", FP8Recipe())], device=((9, 0), "12.9"))
    check_te_run(**kwargs, install=read_install(importer=_loads))  # a fitting install starts
    with pytest.raises(ConfigError) as err:
        check_te_run(**kwargs, install=broken)
    assert str(err.value).startswith("transformer-engine does not fit torch")
    assert "\n" not in str(err.value)


def test_te_install_tested_versions_are_the_extra_pins():
    """setup.py's `gpu` extra pins exactly the release each tested line names."""
    import pathlib

    setup = (pathlib.Path(te_install.__file__).parents[2] / "setup.py").read_text()
    for line, marker in (("0.16", '< "3.12"'), ("0.19", '>= "3.12"')):
        pin = f"'transformer-engine[pytorch]=={te_install.TESTED_TE[line]}; python_version {marker}'"
        assert pin in setup, pin


def test_te_install_source_build_in_one_distribution_passes(tmp_path, monkeypatch):
    """NGC's containers build TE from source: one `transformer_engine` distribution holding the
    extension, no `transformer_engine_torch` one. If it loads, it fits; if not, it is named."""
    if torch.version.cuda is None:
        monkeypatch.setattr(torch.version, "cuda", "12.8")
    _dist(tmp_path, "transformer_engine", "2.11.0+abc1234")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert install_problem(read_install(importer=_loads)) is None
    problem = install_problem(read_install(importer=_undefined_symbol))
    assert problem is not None and "transformer_engine_torch" in problem and "\n" not in problem
