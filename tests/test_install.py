"""A non-editable install works from any directory: no module finds a file through the source
tree's layout, and the files the code reads at run time ship inside the package
(``megatron_oar/resources``, read with importlib.resources).

The slow tests build an sdist from a copy of the tree (setup.py, pyproject.toml and the packages;
the working tree is not written to), build the package from that sdist into a fresh directory
(``pip install --no-deps --no-build-isolation --target``: the locked environment has setuptools
and wheel) and run the installed copy with only that directory on PYTHONPATH, from an empty
directory: ``oar demo --help``, ``oar plan`` and ``oar launch --dryrun`` on the shipped CPU config.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from megatron_oar import resources

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("megatron_oar", "checkpoints_convert", "benchmarks")  # setup.py's find_packages
# ``__file__`` in a shipped module: only where the path is about the import location itself
ALLOWED_FILE_USES = {
    "benchmarks/common.py": "IMPORT_ROOT, the directory holding the packages, for workers' PYTHONPATH",
}


# ----------------------------------------------------------------------------------- fast checks

def test_examples_link_to_the_packaged_configs():
    """examples/tiny_*.yaml are symlinks to the package's copies (one file each, no drift)."""
    for name in ("tiny_cpu.yaml", "tiny_chain_cpu.yaml", "tiny_credit_cpu.yaml"):
        link = REPO / "examples" / name
        assert link.is_symlink(), f"{link}: expected a symlink to megatron_oar/resources/{name}"
        assert link.resolve() == resources.path(name).resolve()
    assert (REPO / "launch_scripts" / "env.sh").resolve() == resources.path("env.sh").resolve()


def test_resources():
    for name in resources.NAMES:
        path = resources.path(name)
        assert path.is_file() and path.parent == REPO / "megatron_oar" / "resources"
    with pytest.raises(ValueError, match="not a shipped resource"):
        resources.path("other.yaml")


def test_no_module_finds_files_through_the_source_tree():
    """No shipped module derives a path from its own location (``Path(__file__).parents[...]``):
    after ``pip install .`` that points into site-packages, where examples/ and launch_scripts/
    are not. Files the code needs go in megatron_oar/resources (package data)."""
    uses = []
    for pkg in PACKAGES:
        for f in sorted((REPO / pkg).rglob("*.py")):
            tree = ast.parse(f.read_text(), str(f))
            if any(isinstance(n, ast.Name) and n.id == "__file__" for n in ast.walk(tree)):
                uses.append(f.relative_to(REPO).as_posix())
    assert sorted(set(uses) - set(ALLOWED_FILE_USES)) == []


# ------------------------------------------------------------------------- the installed copy

def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, f"{cmd}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """The package built from an sdist and installed, non-editable, into a fresh directory."""
    tmp = tmp_path_factory.mktemp("install")
    src, dist, site = tmp / "src", tmp / "dist", tmp / "site"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist")
    for name in ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in", *PACKAGES):
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        elif path.is_file():
            shutil.copyfile(path, src / name)
    _run([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(dist)], cwd=src)
    (tarball,) = dist.glob("*.tar.gz")
    with tarfile.open(tarball) as tar:
        members = tar.getnames()
        tar.extractall(tmp / "sdist", filter="data")
    (unpacked,) = (tmp / "sdist").iterdir()
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
          "--no-index", "--disable-pip-version-check", "--target", str(site), str(unpacked)], cwd=tmp)
    oar = [str(site / "bin" / "oar")]  # the console script
    work, home = tmp / "work", tmp / "home"
    work.mkdir(), home.mkdir()
    # only the installed copy importable, beside the environment's site-packages (its editable
    # install of this checkout comes after PYTHONPATH)
    env = {**os.environ, "PYTHONPATH": str(site), "HOME": str(home)}
    env.pop("NEMORUN_HOME", None)
    return {"site": site, "oar": oar, "env": env, "work": work, "sdist": members}


def _oar(installed: dict, *args: str) -> subprocess.CompletedProcess:
    return _run([*installed["oar"], *args], cwd=installed["work"], env=installed["env"])


@pytest.mark.slow
@pytest.mark.e2e
def test_sdist_and_install_ship_the_resources(installed):
    for name in resources.NAMES:
        assert any(m.endswith(f"/megatron_oar/resources/{name}") for m in installed["sdist"]), name
        assert (installed["site"] / "megatron_oar" / "resources" / name).is_file(), name


@pytest.mark.slow
@pytest.mark.e2e
def test_installed_copy_reads_its_own_files(installed):
    """From an empty directory, the installed copy is what is imported, and every formerly
    repo-relative read finds its file inside it."""
    code = ("import json, megatron_oar, benchmarks.common as common\n"
            "from benchmarks import attribution\n"
            "from megatron_oar.commands import demo, launch\n"
            "from megatron_oar.repro import runner\n"
            "print(json.dumps({'package': megatron_oar.__file__, 'env_sh': str(launch.ENV_SH),\n"
            "    'env': launch.parse_env_sh(), 'demo': str(demo.EXAMPLE), 'task': demo.demo_task().task,\n"
            "    'repro': str(runner.CONFIG), 'bench_root': str(common.IMPORT_ROOT)}))\n")
    r = _run([sys.executable, "-c", code], cwd=installed["work"], env=installed["env"])
    got = json.loads(r.stdout.strip().splitlines()[-1])
    site = installed["site"].resolve()
    for key in ("package", "env_sh", "demo", "repro"):
        assert Path(got[key]).resolve().is_relative_to(site), (key, got[key])
    assert Path(got["bench_root"]).resolve() == site
    assert got["task"] == "chain" and got["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


@pytest.mark.slow
@pytest.mark.e2e
def test_installed_oar_demo_help(installed):
    r = _oar(installed, "demo", "--help")
    assert r.stdout.startswith("usage: oar demo") and "--sft-steps" in r.stdout


@pytest.mark.slow
@pytest.mark.e2e
def test_installed_oar_plan(installed):
    config = installed["site"] / "megatron_oar" / "resources" / "tiny_cpu.yaml"
    r = _oar(installed, "plan", "--config", str(config), "--arch", "qwen2.5-0.5b")
    assert "FITS: peak" in r.stdout


@pytest.mark.slow
@pytest.mark.e2e
def test_installed_oar_launch_dryrun(installed):
    """The env.sh defaults come from the installed package; nothing is written anywhere."""
    config = installed["site"] / "megatron_oar" / "resources" / "tiny_cpu.yaml"
    r = _oar(installed, "launch", "--config", str(config), "--arch", "qwen2.5-0.5b", "--dryrun",
             "rollout.gpu_memory_utilization=0.4")
    assert r.stdout.startswith("# oar launch --dryrun: nemo-run would run")
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1\n" in r.stdout
    assert (f"-m megatron_oar.commands.train --config {config} rollout.gpu_memory_utilization=0.4"
            in r.stdout)
    assert list(installed["work"].iterdir()) == []


def test_make_lock_keeps_the_lock_files_header(tmp_path):
    """``make lock`` regenerates requirements/cpu-lock.txt from ``pip freeze`` and keeps its
    header comment (here in a copy of the Makefile, with a stand-in ``pip``: about 0.1 s)."""
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    (tmp_path / "requirements").mkdir()
    lock = (REPO / "requirements" / "cpu-lock.txt").read_text().splitlines()
    header = lock[:next(i for i, line in enumerate(lock) if not line.startswith("#"))]
    (tmp_path / "requirements" / "cpu-lock.txt").write_text("\n".join(header + ["old==0"]) + "\n")
    (tmp_path / "bin").mkdir()
    pip = tmp_path / "bin" / "pip"
    pip.write_text("#!/bin/sh\nprintf 'torch==2\\ntorchvision==1\\nzzz==3\\n'\n")
    pip.chmod(0o755)
    subprocess.run(["make", "-s", "lock", f"BIN={tmp_path / 'bin'}"], cwd=tmp_path, check=True, timeout=60)
    assert header and (tmp_path / "requirements" / "cpu-lock.txt").read_text().splitlines() == header + [
        "torch==2", "zzz==3"]
