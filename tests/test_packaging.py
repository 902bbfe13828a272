"""The install files agree with each other and ``import trace_replay`` stays light."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_environment_yml_matches_pyproject():
    """environment.yml installs this package with extras that pyproject defines, and vLLM."""
    env = (ROOT / "environment.yml").read_text()
    project = _pyproject()["project"]
    extras = re.search(r"-e \.\[([a-z,]+)\]", env)
    assert extras, "environment.yml must install this package (-e .[...])"
    for extra in extras.group(1).split(","):
        assert extra in project["optional-dependencies"], extra
    assert "gpu" in extras.group(1) and "notebook" in extras.group(1)
    python = re.search(r"python=(\d+)\.(\d+)", env)
    floor = re.search(r">=(\d+)\.(\d+)", project["requires-python"])
    assert tuple(map(int, python.groups())) >= tuple(map(int, floor.groups()))
    vllm_env = re.search(r"- (vllm[^\s#]*)", env).group(1)
    assert vllm_env in project["optional-dependencies"]["gpu"]


def test_extras_and_console_script():
    """The extras the README names exist, ``make install`` installs the CPU ones, and the
    console script points at the CLI."""
    project = _pyproject()["project"]
    assert {"notebook", "cpu", "gpu", "dev", "ray"} <= set(project["optional-dependencies"])
    install = re.search(r'-e "\.\[([a-z,]+)\]"', (ROOT / "Makefile").read_text())
    assert set(install.group(1).split(",")) == {"cpu", "notebook", "dev", "ray"}
    assert project["scripts"]["trace-replay"] == "trace_replay.cli:main"


def test_import_is_light():
    """``import trace_replay`` imports neither vllm nor transformers (nor triton, nor ray,
    whose cluster runs import it when asked for)."""
    code = (
        "import sys, trace_replay; "
        "print(sorted(m for m in ('vllm', 'transformers', 'triton', 'ray') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"


def test_functions_named_like_their_modules_stay_functions():
    """tr.replay and tr.record are the functions even when their modules were imported first
    (importing a submodule binds it on the package under the same name)."""
    code = (
        "import trace_replay.runs.replay, trace_replay.runs.recording, trace_replay as tr; "
        "from trace_replay import replay; "
        "print(type(tr.replay).__name__, type(tr.record).__name__, type(replay).__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.split() == ["function", "function", "function"]


def test_public_names_resolve():
    """Every name in ``trace_replay.__all__`` resolves."""
    import trace_replay

    for name in trace_replay.__all__:
        assert getattr(trace_replay, name) is not None, name


def test_wheel_ships_the_bundled_traces(tmp_path):
    """A built wheel holds the bundled trace files, and trace_replay.datasets loads all of them
    from the wheel alone, with no source checkout around (Python imports straight from it)."""
    import shutil
    import zipfile

    # built from a copy: setuptools writes build/ and *.egg-info next to the sources
    source = tmp_path / "source"
    shutil.copytree(
        ROOT / "trace_replay", source / "trace_replay", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("trace_replay-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {
        "trace_replay/datasets/humaneval_human.jsonl",
        "trace_replay/datasets/gsm8k_cot_model.jsonl",
    } <= set(names)
    code = (
        "import trace_replay as tr; "
        "print(tr.__file__.startswith(sys.argv[1]), len(tr.datasets.load()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", "import sys; " + code, str(wheel)],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(wheel)},
    )
    assert out.stdout.split() == ["True", "64"]


def _shadow_site_packages(folder: Path) -> Path:
    """A folder of links to everything installed beside this interpreter but this package
    itself: a new virtualenv reads its dependencies from there (no download, no second
    torch), while ``trace_replay`` can only come from what is installed into it."""
    import site

    source = Path(next(p for p in site.getsitepackages() if Path(p).is_dir()))
    folder.mkdir()
    for entry in source.iterdir():
        name = entry.name.lower().replace("-", "_")
        if not (
            name.startswith("trace_replay")
            or name.startswith("__editable__")
            or name.endswith(".pth")
        ):
            (folder / entry.name).symlink_to(entry)
    return folder


@pytest.mark.slow
def test_the_built_wheel_installs_into_a_clean_virtualenv_and_replays(tmp_path):
    """``python -m build`` gives a wheel and an sdist without setuptools' licence warning,
    ``twine check`` passes both, and the wheel, installed into a new virtualenv with no
    index (its dependencies already installed, seen through a path file), gives a
    ``trace-replay`` whose ``--help`` works and that replays one trace on the embedded
    model (prefill engine) from the installed copy, not this checkout."""
    import json
    import shutil

    import pandas as pd

    source = tmp_path / "source"
    shutil.copytree(
        ROOT / "trace_replay", source / "trace_replay", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--no-isolation",
            "--outdir",
            str(tmp_path / "dist"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert "project.license" not in built.stdout + built.stderr  # the TOML-table warning
    (wheel,) = (tmp_path / "dist").glob("trace_replay-*.whl")
    (sdist,) = (tmp_path / "dist").glob("trace_replay-*.tar.gz")
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr

    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    site_packages = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    shadow = _shadow_site_packages(tmp_path / "installed")
    (Path(site_packages) / "_installed.pth").write_text(f"{shadow}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    installed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-index",
            "-q",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr

    cli = venv / "bin" / "trace-replay"
    helped = subprocess.run(
        [str(cli), "--help"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert helped.returncode == 0 and "replay" in helped.stdout, helped.stderr
    where = subprocess.run(
        [str(python), "-c", "import trace_replay; print(trace_replay.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=True,
    )
    assert where.stdout.startswith(site_packages), where.stdout
    traces = tmp_path / "one.jsonl"
    traces.write_text(
        json.dumps({"id": "paris", "prompt": "The capital of France is", "completion": " Paris."})
        + "\n"
    )
    out = tmp_path / "one.parquet"
    replayed = subprocess.run(
        [
            str(cli),
            "replay",
            str(traces),
            "--engine",
            "prefill",
            "--device",
            "cpu",
            "--out",
            str(out),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    df = pd.read_parquet(out)
    assert df["token"].tolist() == [" Paris", "."] and (df["rank"] == 1).all()
