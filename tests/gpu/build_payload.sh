#!/usr/bin/env bash
# Builds gpu_payload/ (git-ignored), the files that tests/gpu/lent_gpu_run.sh carries to a lent GPU
# machine (Python 3.12, torch 2.11.0+cu130 with cuBLAS 13.1.0.3, nvcc 13.0, sm_90, no internet,
# 64 MiB per call). Run here, where pip reaches the package registry; from the repository root or
# anywhere: the paths are relative to the repository. Needs python3 with pip, unzip, zstd, nm
# (binutils), split; about 1.5 GB of disk in gpu_payload/build/ (2.5 GB with cublas).
#
#   bash tests/gpu/build_payload.sh [deps|te|vllm|all|cublas]     (default: all; cublas only on request)
#
# What it makes (sizes as built on 2026-11-27):
#   gpu_payload/deps/        the setup stage's DEPS folder: cp312/py3 wheels the image lacks
#                            (megatron-core 0.16.1, omegaconf 2.4.0 (antlr vendored), math-verify
#                            0.9.0 + latex2sympy2_extended 1.11.0 + antlr4-python3-runtime 4.13.2,
#                            pydantic 2 + pydantic-core + annotated-types + typing-inspection +
#                            typing-extensions (Transformer Engine's recipes import pydantic),
#                            ninja, zstandard (a Python zstd decoder, used only where no zstd
#                            binary runs), the vLLM 0.24 imports listed in VLLM_DEPS below, TRL
#                            1.16.0 with datasets, dill, multiprocess (TRL_DEPS, about 1.5 MB;
#                            not yet built: the sizes below predate it)), the
#                            zstd binary of this machine with the libraries it links beside glibc,
#                            and te_torch.tar.gz: Transformer Engine's torch-extension sdist
#                            (C++ only, built there by the te stage)
#                            38 files, 29.0 MB (27.6 MiB)
#   gpu_payload/te.aa ...    Transformer Engine 2.12.0's cu13 core wheel and its metapackage wheel,
#                            unpacked without transformer_engine/jax, tar | zstd, 55 MiB pieces;
#                            491 MB unpacked, libtransformer_engine.so 488 MB of it; 140.4 MB
#                            of zstd (133.9 MiB): te.aa, te.ab 55 MiB, te.ac 25.0 MB
#   gpu_payload/vz.aa ...    vLLM 0.24.0's wheel unpacked and trimmed (below), tar | zstd, 55 MiB
#                            pieces: 346 MB unpacked, 139.8 MB of zstd (133.3 MiB): vz.aa, vz.ab
#                            55 MiB, vz.ac 24.5 MB
#   gpu_payload/build/       downloads and staging (not carried; delete at will)
# Six calls carry it all, each under 64 MiB with the repository: setup with deps/ and te.ac, te.aa,
# te.ab (then the te stage), vz.aa, vz.ab, vz.ac (then the vllm stage); lent_gpu_run.sh's header has
# the calls.
#
# Why TE 2.12 and no cuBLAS: TE 2.13's and 2.14's cu13 libtransformer_engine.so import
# cublasLtGroupedMatrixLayoutInit_internal (libcublasLt.so.13), which cuBLAS 13.1 lacks (the
# 2026-11-26 lease: TE 2.14 did not load). By `nm -D --undefined-only`, 2.9, 2.10, 2.11 and 2.12
# import 13 cuBLAS symbols (cublasGetStatusString and 12 cublasLt* ones), all exported by
# nvidia-cublas 13.1.0.3, and 2.12's 53 cudart symbols are all in nvidia-cuda-runtime 13.0.96.
# Carrying a newer cuBLAS instead costs 7 pieces (libcublas + libcublasLt 13.10, 421 MB of zstd) or
# 6 (libcublasLt 13.2.2.2 alone, 502.6 MB, 329.1 MB of zstd: `cublas` below); the cublas stage of
# lent_gpu_run.sh stays for that case. te() below checks the symbol (TE_VERSION=2.14.0 warns).
set -euo pipefail
cd "$(dirname "$0")/../.."
P=gpu_payload
B=$P/build
D=$P/deps
TE_VERSION=${TE_VERSION:-2.12.0}
VLLM_VERSION=0.24.0
PIECE=55M
# -19 with a 128 MiB window, one thread (the machine's cores are shared): te took 20 min, vz 7 min
# here; a lower ZSTD_LEVEL trades size for time
ZSTD_LEVEL=${ZSTD_LEVEL:-19}
# manylinux_2_31 for llguidance; the image's glibc is newer than that (Python 3.12.3, CUDA 13)
PLATFORMS="--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux1_x86_64"

pipdl() {  # pipdl DIR SPEC...: cp312 x86_64 wheels, no dependencies
  local dir=$1
  shift
  python3 -m pip download -q --no-deps --python-version 3.12 --implementation cp --abi cp312 --abi abi3 \
    --abi none --only-binary=:all: $PLATFORMS -d "$dir" "$@"
}

pack() {  # pack NAME STAGE_DIR: STAGE_DIR's contents as NAME.aa, NAME.ab, ... in gpu_payload/
  local name=$1 stage=$2
  rm -f "$P/$name".??
  (cd "$stage" && tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - -- *) |
    zstd -q -"$ZSTD_LEVEL" --long=27 -T1 | split -b $PIECE -a 2 - "$P/$name."
  ls -l "$P/$name".??
}

# megatron-core and what the project imports that the lent image lacks (the device tool's notes list
# the image's packages: einops, ninja, pybind11, pytest, rich, sympy, pyyaml, onnx, ... are there)
PROJECT_DEPS="megatron-core==0.16.1 omegaconf==2.4.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0
  antlr4-python3-runtime==4.13.2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 typing-extensions==4.16.0 ninja==1.13.2 zstandard==0.25.0"
# vLLM 0.24's imports on the path that the project takes (the LLM class, the V1 engine core and
# its client, the GPU worker and both model runners, FlashAttention, Qwen2/Qwen3-MoE, fused MoE, CUDA
# graphs, the sampler, structured-output backends that its dataclasses name at import), less what
# the image has: found by importing those modules with every other package blocked. Versions: the
# newest that vLLM 0.24's requirements allow, except xgrammar: vLLM pins apache-tvm-ffi==0.1.9 (for
# FlashInfer, not carried), which only xgrammar 0.2.5.post1 (48 MB) accepts; 0.2.8 (1.3 MB) needs
# tvm-ffi >= 0.1.11, and nothing carried uses tvm-ffi but xgrammar. Left out as not imported on
# that path: mistral_common (Mistral tokenizers), ray, opentelemetry, FlashInfer and the CUTLASS
# DSL, depyf (only to print a failed CUDA-graph capture), setproctitle (optional), blake3
# (multimodal hashing). openai 3.x imports httpx2 (not the image's httpx): its requirements follow
# it, with idna, anyio and h11 at the versions they ask for (the image's may be older).
VLLM_DEPS="cbor2==6.3.0 msgspec==0.22.0 pyzmq==27.3.0 pybase64==1.5.1 cachetools==8.0.2 openai==3.57.0
  openai-harmony==0.0.8 fastapi==0.136.3 starlette==1.10.0 partial-json-parser==0.2.1.1.post7
  llguidance==1.7.6 xgrammar==0.2.8 apache-tvm-ffi==0.1.11
  httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1 idna==3.20
  anyio==4.16.0 h11==0.16.0"

# `oar bench vs-trl` (issue 52): TRL 1.16.0 and what it imports that the image lacks (the image has
# accelerate 1.15.0, pandas, pyarrow, xxhash, fsspec, huggingface-hub; device notes, 2026-11-17)
TRL_DEPS="trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19"

deps() {
  rm -rf "$D" && mkdir -p "$D"
  # shellcheck disable=SC2086
  pipdl "$D" $PROJECT_DEPS
  # shellcheck disable=SC2086
  pipdl "$D" $TRL_DEPS
  # shellcheck disable=SC2086
  [ -z "$VLLM_DEPS" ] || pipdl "$D" $VLLM_DEPS
  # the zstd binary and the libraries it links other than glibc's, for a machine without zstd
  local zstd
  zstd=$(command -v zstd)
  cp "$zstd" "$D/zstd"
  ldd "$zstd" | awk '$3 ~ /^\// {print $3}' | grep -vE '/lib(c|m|pthread|dl|rt)\.so' | xargs -r -I{} cp -L {} "$D/"
  te_torch_sdist
  du -sh "$D" && ls -l "$D"
}

te_torch_sdist() {  # TE's torch-extension sdist as deps/te_torch.tar.gz
  # pip prepares an sdist's metadata before saving it, and this setup.py imports torch and reads
  # torch.version.cuda; a stand-in torch (and setuptools/wheel for its imports) lets pip do that
  # here without a CUDA torch. The lent machine builds it with its own torch.
  local stub=$PWD/$B/torch_stub  # absolute: pip runs the metadata hook in another folder
  rm -rf "$stub" "$B/te_torch" && mkdir -p "$stub/torch/utils" "$B/te_torch"
  printf '__version__ = "2.11.0"\nfrom . import utils, version  # noqa: F401\n' >"$stub/torch/__init__.py"
  printf 'cuda = "13.0"\n' >"$stub/torch/version.py"
  : >"$stub/torch/utils/__init__.py"
  printf '%s\n' 'import setuptools' \
    'from setuptools.command.build_ext import build_ext as BuildExtension  # noqa: F401' '' \
    'def CppExtension(name, sources, **kwargs):' '    return setuptools.Extension(name, sources, **kwargs)' \
    >"$stub/torch/utils/cpp_extension.py"
  python3 -m pip install -q --target "$stub" setuptools wheel packaging
  PYTHONPATH=$stub python3 -m pip download -q --no-deps --no-binary :all: --no-build-isolation \
    -d "$B/te_torch" "transformer-engine-torch==$TE_VERSION"
  cp "$B/te_torch/transformer_engine_torch-$TE_VERSION.tar.gz" "$D/te_torch.tar.gz"
}

te() {
  local dl=$B/te stage=$B/te/stage
  rm -rf "$dl" && mkdir -p "$stage"
  pipdl "$dl" "transformer-engine-cu13==$TE_VERSION" "transformer-engine==$TE_VERSION"
  # the core wheel (libtransformer_engine.so, its dist-info) and the metapackage's dist-info: TE's
  # import checks both by their metadata (sanity_checks_for_pypi_installation, __version__)
  (cd "$stage" && for w in ../*.whl; do unzip -q -o "$w"; done)
  rm -rf "$stage/transformer_engine/jax"
  if nm -D --undefined-only "$stage/transformer_engine/wheel_lib/libtransformer_engine.so" |
    grep -q cublasLtGroupedMatrixLayoutInit_internal; then
    echo "WARNING: TE $TE_VERSION imports cublasLtGroupedMatrixLayoutInit_internal: cuBLAS 13.1 lacks it (cb.* pieces needed)"
  fi
  pack te "$stage"
}

vllm() {
  # the wheel less what a one-GPU Hopper run of the project does not load: FlashAttention 2's
  # kernels (FA3 serves sm_90), DeepGEMM and the Blackwell FMHA sources, the Rust HTTP frontend
  # (vllm-rs), QuTLASS's FP4 kernels (Blackwell; imported under try). Kept: the _C and _moe_C
  # kernels, FA3, FlashMLA, cumem_allocator (sleep mode), vllm/third_party's pynvml and Triton kernels.
  local dl=$B/vllm stage=$B/vllm/stage
  rm -rf "$dl" && mkdir -p "$stage"
  pipdl "$dl" "vllm==$VLLM_VERSION"
  (cd "$stage" && unzip -q ../vllm-*.whl -x 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' \
    'vllm/third_party/deep_gemm/*' 'vllm/third_party/fmha_sm100/*' 'vllm/vllm-rs' 'vllm/_qutlass_C.abi3.so')
  du -sh "$stage"
  pack vz "$stage"
}

cublas() {
  # only for a TE that imports the grouped-layout symbol (TE_VERSION >= 2.13): cb.* pieces for the
  # cublas stage, nvidia/cu13/lib/<lib> in the tar (the stage strips 3 components). Every
  # nvidia-cublas from 13.2.0.9 on exports the symbol and every cublasLt symbol that torch's
  # libcublas 13.1 imports, so CUBLAS_LIBS=libcublasLt.so.13 alone is enough by symbols (whether an
  # older libcublas runs against a newer libcublasLt is NVIDIA's to say: untested)
  local v=${CUBLAS_VERSION:-13.2.2.2} libs=${CUBLAS_LIBS:-"libcublasLt.so.13 libcublas.so.13"}
  local dl=$B/cublas stage=$B/cublas/stage
  rm -rf "$dl" && mkdir -p "$stage"
  pipdl "$dl" "nvidia-cublas==$v"
  (cd "$stage" && for l in $libs; do unzip -q ../nvidia_cublas-*.whl "nvidia/cu13/lib/$l"; done)
  pack cb "$stage"
}

mkdir -p "$B"
case ${1:-all} in
deps) deps ;;
te) te ;;
vllm) vllm ;;
cublas) cublas ;;
all) deps && te && vllm ;;
*) echo "usage: $0 [deps|te|vllm|all|cublas]" >&2 && exit 2 ;;
esac
