"""One C++ build for a graph's CPU kernels (funcamp/compiler/cpp_bundle.py): the same bits as
inductor's one build per kernel, fewer builds, and inductor's own way when bundling fails."""

import glob
import logging
import os
import re

import pytest
import torch

import funcamp
from funcamp.compiler import cpp_bundle
from funcamp.compiler.cpp_bundle import bundling, unit_source

pytestmark = pytest.mark.skipif(not cpp_bundle.supported(), reason="this torch builds otherwise")

try:
    from torch._inductor.utils import fresh_cache
except ImportError:  # torch < 2.8
    from torch._inductor.utils import fresh_inductor_cache as fresh_cache


def f(x, w):  # each matmul (an extern call) ends a kernel: four kernels
    a = torch.relu(x @ w) * 2 + 1
    b = (a @ w.t()).softmax(-1)
    c = torch.tanh(b @ w) - 0.5
    d = (c @ w.t()).sigmoid()
    return b.sum(0), c.exp().mean(), d.to(torch.bfloat16).sum(1)


def inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 8, generator=g), torch.randn(8, 16, generator=g)


def cpp_sources(directory):
    """The C++ kernel sources inductor wrote under ``directory``."""
    out = []
    for p in glob.glob(os.path.join(directory, "**", "*.cpp"), recursive=True):
        with open(p) as fh:
            text = fh.read()
        if "cpp_prefix.h" in text:
            out.append(text)
    return out


def compiled_once(enabled, fn=f, args=None):
    """``fn`` compiled by inductor in a fresh cache: (outputs, the .cpp sources it built)."""
    torch._dynamo.reset()
    with fresh_cache():
        directory = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        with bundling(enabled):
            out = torch.compile(fn, fullgraph=True)(*(args or inputs()))
        sources = cpp_sources(directory)
    torch._dynamo.reset()
    return out, sources


@pytest.fixture(scope="module")
def per_kernel():
    return compiled_once(False)


def test_bundled_kernels_give_the_same_bits_from_fewer_builds(per_kernel):
    expected, alone = per_kernel
    out, built = compiled_once(True)
    assert len(alone) >= 3  # the function makes several kernels, each built on its own
    for a, b in zip(out, expected):
        assert torch.equal(a, b) and a.dtype == b.dtype
    units = [s for s in built if "namespace funcamp_k0" in s]
    threads = torch._inductor.async_compile.get_compile_threads()
    assert 1 <= len(units) <= max(1, threads)
    assert sum(len(re.findall(r"namespace funcamp_k\d+ \{", s)) for s in units) == len(alone)


def test_one_compile_thread_gets_the_kernels_themselves(per_kernel):
    """With one compile thread (a one-core machine, ``TORCHINDUCTOR_COMPILE_THREADS=1``) the
    graph's module waits for no future: it is handed the bundled kernels themselves."""
    expected, alone = per_kernel
    with torch._inductor.config.patch(compile_threads=1):
        out, built = compiled_once(True)
    for a, b in zip(out, expected):
        assert torch.equal(a, b) and a.dtype == b.dtype
    units = [s for s in built if "namespace funcamp_k0" in s]
    assert len(units) == 1
    assert len(re.findall(r"namespace funcamp_k\d+ \{", units[0])) == len(alone)


def test_a_unit_that_fails_to_build_falls_back_to_one_build_per_kernel(
    per_kernel, monkeypatch, caplog
):
    expected, _ = per_kernel
    broken = lambda kernels: unit_source(kernels) + "\nthis is not C++;\n"  # noqa: E731
    monkeypatch.setattr(cpp_bundle, "unit_source", broken)
    monkeypatch.setattr(cpp_bundle, "_FAILED", [])
    with caplog.at_level(logging.WARNING, logger="funcamp"):
        out, built = compiled_once(True)
    for a, b in zip(out, expected):
        assert torch.equal(a, b)
    assert "built one by one" in caplog.text
    assert sum("namespace funcamp_k" not in s for s in built) >= 3  # each kernel on its own


def test_the_environment_switch_turns_it_off(per_kernel, monkeypatch):
    monkeypatch.setenv("FUNCAMP_CPP_BUNDLE", "0")
    _, built = compiled_once(None)
    assert built and not any("namespace funcamp_k" in s for s in built)


def test_only_plain_kernel_sources_are_held():
    prefix = "#include <torch/csrc/inductor/cpp_prefix.h>\n"
    kernel = 'extern "C"  void  kernel(const float* in_ptr0, float* out_ptr0)\n{\n'
    body = "    #pragma omp parallel\n    out_ptr0[0] = in_ptr0[0];\n}\n"
    assert cpp_bundle._plain(prefix + kernel + body)
    assert not cpp_bundle._plain(kernel + body)  # no prefix include
    assert not cpp_bundle._plain(prefix + "#include <vector>\n" + kernel + body)
    assert not cpp_bundle._plain(prefix + "#define N 4\n" + kernel + body)
    assert not cpp_bundle._plain(prefix + kernel + body + kernel + body)  # two entry points
    assert cpp_bundle._plain_args(["const float*", "float*", "const c10::BFloat16*", "int64_t"])
    assert not cpp_bundle._plain_args(["float (*)[4]"])


def test_units_start_while_code_is_generated_and_a_cached_graph_makes_the_same_units(
    per_kernel, monkeypatch
):
    """Small units: they are cut as inductor generates the kernels (each kernel found again when
    the module loads); a second load of the same graph from inductor's cache, with no code
    generation, asks for the same units (the same sources, so the same built files)."""
    expected, alone = per_kernel
    monkeypatch.setattr(cpp_bundle, "UNIT_BYTES", 1)  # a unit per kernel
    units = []
    submit = cpp_bundle._submit

    def recording(slots):
        units.append(cpp_bundle.unit_source([(s.argtypes, s.source) for s in slots]))
        submit(slots)

    monkeypatch.setattr(cpp_bundle, "_submit", recording)
    codecache = torch._inductor.codecache
    torch._dynamo.reset()
    with fresh_cache():
        with bundling(True):
            out = torch.compile(f, fullgraph=True)(*inputs())
        generated = list(units)
        assert not cpp_bundle._EARLY and not cpp_bundle._HELD  # every kernel found again
        units.clear()
        torch._dynamo.reset()
        codecache.PyCodeCache.cache_clear()  # the graph's module loads again from disk
        codecache.CppPythonBindingsCodeCache.cache_clear()
        with bundling(True):
            again = torch.compile(f, fullgraph=True)(*inputs())
    torch._dynamo.reset()
    assert len(generated) == len(alone)
    assert units == generated
    for a, b, c in zip(out, again, expected):
        assert torch.equal(a, c) and torch.equal(b, c)


def test_parse_reads_a_kernel_definition_as_python_does():
    src = '#include <torch/csrc/inductor/cpp_prefix.h>\nextern "C" void kernel(float* p)\n{ }\n'
    q = "'" * 3
    body = f"async_compile.cpp_pybinding(['float*'], r{q}\n{src}{q})\n"
    assert cpp_bundle._parse(body) == (["float*"], "\n" + src)
    assert cpp_bundle._parse(f"async_compile.triton('k', {q}...{q})") is None
    assert (
        cpp_bundle._parse(f"async_compile.cpp_pybinding(['float*'], r{q}\n#define X\n{q})") is None
    )


def test_a_unit_names_one_function_per_kernel():
    prefix = "#include <torch/csrc/inductor/cpp_prefix.h>\n"
    k = prefix + 'extern "C" void kernel(const float* in_ptr0, float* out_ptr0)\n{ }\n'
    src = unit_source([(["const float*", "float*"], k), (["const float*", "float*"], k)])
    assert src.count("#include <torch/csrc/inductor/cpp_prefix.h>") == 1
    assert 'extern "C"' not in src.split("Python bindings")[0]
    assert '{"kernel_0", kernel_0_py' in src and '{"kernel_1", kernel_1_py' in src
    assert "funcamp_k1::kernel(parse_arg<float*>(args, 0), parse_arg<float*>(args, 1))" in src
    assert "PyInit_kernel(void)" in src


def test_a_compiled_train_step_builds_its_kernels_together_with_the_same_bits():
    """make_train_step's compiled step with the patches chosen (run_compiled turns bundling on):
    the same state after two steps as with torch's one build per kernel."""

    def run(env):
        os.environ["FUNCAMP_CPP_BUNDLE"] = env
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)
            )
            params = dict(model.named_parameters())
            opt = funcamp.adamw(1e-2)
            policy = funcamp.get_policy("mixed_bfloat16")

            def loss_fn(p, buffers, x):
                return torch.func.functional_call(model, p, (x,)).square().mean()

            state = funcamp.TrainState.create(params, opt, policy)
            step = funcamp.make_train_step(
                loss_fn,
                opt,
                policy,
                donate_state=False,
                compile=funcamp.Compile(compiler_patches=True),
            )
            x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
            torch._dynamo.reset()
            with fresh_cache():
                directory = os.environ["TORCHINDUCTOR_CACHE_DIR"]
                for _ in range(2):
                    state, _ = step(state, x)
                units = [s for s in cpp_sources(directory) if "namespace funcamp_k0" in s]
            return state, units
        finally:
            os.environ.pop("FUNCAMP_CPP_BUNDLE", None)
            torch._dynamo.reset()

    alone, none = run("0")
    together, units = run("1")
    assert not none and units
    for a, b in zip(
        torch.utils._pytree.tree_leaves(together.params),
        torch.utils._pytree.tree_leaves(alone.params),
    ):
        assert torch.equal(a, b)
