"""Coverage-guided fuzzing of one target with atheris (libFuzzer); arguments after the target go to libFuzzer.

    python tests/fuzz/run_atheris.py gguf -max_total_time=600 /tmp/gguf-new tests/fuzz/corpus/gguf
    python tests/fuzz/run_atheris.py chat_template -runs=1000 -timeout=10 tests/fuzz/corpus/chat_template
    python tests/fuzz/run_atheris.py gguf -merge=1 tests/fuzz/corpus/gguf /tmp/gguf-new    # keep what adds coverage

The functions of the modules the target exercises (MODULES) are instrumented, so libFuzzer
sees their branch coverage; the Numba kernels are not (their bytecode must stay as written). Give a scratch folder first and the committed corpus second: libFuzzer writes new inputs
into the first. A finding prints its traceback and leaves a crash-* file (-artifact_prefix=).
libFuzzer's last lines give the executions (`Done N runs in S second(s)`) and the coverage
(`DONE cov: C ft: F corp: ...`: C = edges covered of the instrumented modules, F = features).
"""
from __future__ import annotations

import inspect
import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))      # tests/


# the pure-Python modules each target exercises, instrumented for coverage (never a module with
# Numba kernels: Numba must see their bytecode as written)
MODULES = {"gguf": ["ringllm.models.gguf_file", "ringllm.runtime.quant_types", "ringllm.runtime.qtensor"],
           "safetensors": ["ringllm.models.safetensors_file"],
           "session": ["ringllm.session", "ringllm.runtime.kv_config", "ringllm.sampling", "ringllm.constraints",
                       "ringllm.chat_template"],
           "chat_template": ["ringllm.chat_template", "jinja2"],
           "tokenizer": ["ringllm.models.tokenizer"],
           "spm_bpe": ["ringllm.models.spm_bpe", "ringllm.models.tokenizer"],
           "byte_bpe": ["ringllm.models.byte_bpe", "ringllm.models.tokenizer"],
           "server": ["ringllm.server", "ringllm.server_api", "ringllm.server_routes", "ringllm.server_http",
                      "ringllm.server_worker", "ringllm.chat_template", "ringllm.tools"]}
# targets that build state on their first inputs (the bundled model, kernels compiled for every policy
# the corpus names): their corpus runs once before libFuzzer's clock starts, so the clock is spent fuzzing
STATEFUL = {"session", "tokenizer", "server"}


def _instrument_module(mod) -> None:
    """Instrument every function and method defined in `mod` (in place: their __code__ is replaced).
    Per module, not per package as atheris.instrument_imports does: ringllm.runtime holds Numba
    kernels whose bytecode must stay as written."""
    def fix(fn):
        if inspect.isfunction(fn) and fn.__module__ == mod.__name__:
            atheris.instrument_func(fn)

    for obj in list(vars(mod).values()):
        fix(obj)
        if inspect.isclass(obj) and obj.__module__ == mod.__name__:
            for attr in vars(obj).values():
                if isinstance(attr, (staticmethod, classmethod)):
                    attr = attr.__func__
                elif isinstance(attr, property):
                    for f in (attr.fget, attr.fset):
                        fix(f)
                    continue
                fix(attr)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    # argv[0] is what libFuzzer's -merge=1 and -fork=N run again through the shell (its words joined
    # by spaces): this interpreter, this file and the target, so those modes work without an
    # executable script
    name = sys.argv[1]
    argv = [f"{sys.executable} {os.path.abspath(__file__)} {name}"] + sys.argv[2:]
    if "jinja2" in MODULES[name]:
        with atheris.instrument_imports(include=["jinja2"]):     # whole package, before ringllm imports it
            import jinja2  # noqa: F401
    import importlib
    for mod in MODULES[name]:
        if mod != "jinja2":
            _instrument_module(importlib.import_module(mod))
    import fuzz.targets as targets
    target = targets.TARGETS[name]
    for path in targets.corpus_files(name) if name in STATEFUL else []:
        target(open(path, "rb").read())
    atheris.Setup(argv, target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
