"""The ptbr-cpu image: its Dockerfile's promises, then the real thing built from this checkout with
podman, `ptbr smoke` inside it, a `podman stop` that saves a checkpoint, and a rebuild from scratch
that gives the same image ID. All image work goes through docker/build.py, as `nox -s build` does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = ROOT / "docker" / "build.py"
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()
# The sample that ships inside the package, at its path in the image's virtual environment.
IMAGE_SAMPLE = "/opt/ptbr/lib/python3.11/site-packages/ptbr/data/sample"
PODMAN_RUN = ["--runtime", "runc", "--ulimit", "nofile=20000:20000", "--ulimit", "nproc=32768:32768"]

# --- the Dockerfile (fast, no container tools needed) ------------------------------------------


def test_a_copy_of_the_checkout_inside_another_repository_is_built_from_its_own_files(tmp_path):
    """The image test copies the checkout to pytest's temporary folder; where that folder is inside
    another git repository (nox's TMPDIR under .nox/, ignored there), `git ls-files` answered for
    that repository: no file of the copy was listed, and the wheel's build found no source."""
    outer = tmp_path / "outer"
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    (outer / ".gitignore").write_text("ignored/\n")
    copy = outer / "ignored" / "checkout"
    for name in ("docker/build.py", "pyproject.toml", "ptbr/__init__.py", "README.md"):
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, copy / name)
    spec = importlib.util.spec_from_file_location("ptbr_build_copy", copy / "docker" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        assert module.git("ls-files") is None  # not this copy's repository
        assert sorted(map(str, module.checkout_files())) == ["README.md", "ptbr/__init__.py", "pyproject.toml"]
    finally:
        del sys.modules[spec.name]


def instructions(keyword: str) -> list[str]:
    return re.findall(rf"^{keyword}\s+(.+)$", DOCKERFILE, re.MULTILINE)


def test_base_is_pinned_by_digest_and_overridable():
    (base_arg,) = [a for a in instructions("ARG") if a.startswith("BASE_IMAGE=")]
    assert re.search(r"@sha256:[0-9a-f]{64}$", base_arg)
    assert instructions("FROM") == ["${BASE_IMAGE}"]
    registry_base = re.search(r"REGISTRY_BASE = \(\n((?:\s+\"[^\"]+\"\n)+)\)", BUILD_SCRIPT.read_text())
    assert registry_base, "docker/build.py names the base it tries to pull"
    pulled = "".join(re.findall(r'"([^"]+)"', registry_base.group(1)))
    assert pulled == base_arg.split("=", 1)[1], "docker/build.py pulls the Dockerfile's pinned base"


def test_runs_ptbr_as_a_non_root_user_with_the_documented_volumes():
    assert instructions("ENTRYPOINT") == ['["ptbr"]']
    assert instructions("USER") == ["ptbr"]
    assert instructions("VOLUME") == ['["/data", "/out"]']
    labels = " ".join(re.findall(r"org\.opencontainers\.image\.(\w+)=", DOCKERFILE))
    for label in ("source", "revision", "version"):
        assert label in labels


def test_installs_ptbr_from_the_checkout_wheel_and_locked_hashes_only():
    installs = re.findall(r"pip install(?:[^\n]*\\\n)*[^\n]*", DOCKERFILE)
    assert len(installs) == 2
    assert all("--no-index" in line for line in installs), "nothing comes from an index"
    assert "--require-hashes" in installs[0] and "/context/locks/${VARIANT}.txt" in installs[0]
    assert "/context/dist/${PTBR_WHEEL}" in installs[1]
    assert not re.search(r"ARG\s+\w*(TOKEN|PASSWORD|SECRET|KEY)\b", DOCKERFILE), "no credentials"
    assert "COPY" not in DOCKERFILE and "ADD " not in DOCKERFILE, "build inputs never land in a layer"


def load_build_module():
    spec = importlib.util.spec_from_file_location("ptbr_docker_build", BUILD_SCRIPT)
    build = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = build  # dataclasses look their module up while the class is made
    spec.loader.exec_module(build)
    return build


# --- `smoke cuda` asks for the GPU only where one exists (fast: no container is built or run) ----

# A name no machine has, so that the probe relies on the device nodes the test lays out.
NO_NVIDIA_SMI = "ptbr-test-no-nvidia-smi"
CDI_SPEC = """cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
- name: all
"""


def test_smoke_cuda_without_a_gpu_runs_on_the_cpu(tmp_path, capsys):
    build = load_build_module()
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidiactl").touch()  # the driver's control node alone is no GPU
    probe = build.probe_gpu(tmp_path / "dev", (tmp_path / "cdi",), NO_NVIDIA_SMI)
    assert probe == build.GpuProbe((), ())
    for tool in ("podman", "docker"):
        command = build.smoke_command(build.Engine(tool), "cuda", probe)
        assert command[-2:] == ["ptbr-cuda", "smoke"]
        assert not {"--gpus", "--device"} & set(command), command
        assert "no GPU found: running ptbr-cuda's smoke on the CPU" in capsys.readouterr().out


def test_smoke_cuda_with_a_gpu_asks_for_it_and_says_so(tmp_path, capsys):
    build = load_build_module()
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidia0").touch()
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    (cdi / "amd.yaml").write_text(CDI_SPEC.replace("nvidia.com", "amd.com"))
    probe = build.probe_gpu(tmp_path / "dev", (cdi,), NO_NVIDIA_SMI)
    assert probe.gpus == (str(tmp_path / "dev" / "nvidia0"),) and probe.cdi_specs == ()

    docker = build.smoke_command(build.Engine("docker"), "cuda", probe)
    assert docker[docker.index("--gpus") + 1] == "all"
    assert "GPU found" in capsys.readouterr().out
    with pytest.raises(build.BuildError, match="no CDI spec.*nvidia-ctk cdi generate"):
        build.smoke_command(build.Engine("podman"), "cuda", probe)

    (cdi / "nvidia.yaml").write_text(CDI_SPEC)
    probe = build.probe_gpu(tmp_path / "dev", (cdi,), NO_NVIDIA_SMI)
    podman = build.smoke_command(build.Engine("podman"), "cuda", probe)
    assert podman[podman.index("--device") + 1] == "nvidia.com/gpu=all"
    assert podman[-2:] == ["ptbr-cuda", "smoke"]
    assert f"GPU found ({tmp_path / 'dev' / 'nvidia0'}): running ptbr-cuda's smoke on it" in capsys.readouterr().out


def test_smoke_cpu_never_asks_for_a_gpu(tmp_path):
    build = load_build_module()
    probe = build.GpuProbe(("GPU 0: NVIDIA H100 80GB HBM3",), (tmp_path / "nvidia.yaml",))
    command = build.smoke_command(build.Engine("podman"), "cpu", probe)
    assert not {"--gpus", "--device"} & set(command)
    assert command[-2:] == ["ptbr-cpu", "smoke"]


def test_build_docs_stand_alone():
    """docker/, .ci/run and the noxfile name no file outside this repository, and their links
    lead to files that exist (readers of a clone have nothing else)."""
    files = [*sorted((ROOT / "docker").iterdir()), ROOT / ".ci" / "run", ROOT / "noxfile.py"]
    problems = []
    for path in files:
        text = path.read_text()
        targets = re.findall(r"(?<![\w/.])(\.\./[\w./-]+)", text)
        if path.suffix == ".md":
            targets += [t for t in re.findall(r"\]\(([^)#\s]+)", text) if not re.match(r"\w+://", t)]
        for target in targets:
            resolved = (path.parent / target).resolve()
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                problems.append(f"{path.relative_to(ROOT)}: {target}")
    assert not problems, problems


def test_ci_installs_its_tools_then_runs_the_readme_test_command():
    script = ROOT / ".ci" / "run"
    assert os.access(script, os.X_OK)
    commands = [line.strip() for line in script.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    installed = " ".join(command for command in commands if command.startswith("apt-get install"))
    for tool in ("podman", "buildah", "runc", "debootstrap"):
        assert tool in installed.split(), f".ci/run installs {tool} (the image test needs it)"
    assert any("pip install" in command and "nox==" in command for command in commands), \
        ".ci/run installs nox at the version locks/ci.txt pins"
    assert commands[-1] == "nox -s lint tests"
    assert re.search(r"^pip install nox && nox -s lint tests\b", (ROOT / "README.md").read_text(), re.MULTILINE), \
        "the README's test command is the one CI runs"


# --- the real image (podman) -------------------------------------------------------------------


def podman(store: Path) -> list[str]:
    """podman on the test's own store, with the same flags docker/build.py uses."""
    return load_build_module().Engine("podman", store).base_cmd


def container_logs(store: Path, name: str) -> str:
    return subprocess.run([*podman(store), "logs", name], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True).stdout


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A frozen copy of the checkout (the files git would commit), so that both builds see the same
    sources even while someone edits the working tree; the wheelhouse cache stays the real one."""
    copy = tmp_path_factory.mktemp("checkout")
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], capture_output=True, text=True)
    paths = listed.stdout.split("\0") if listed.returncode == 0 else [
        str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if ".cache" not in p.parts]
    for relative in filter(None, paths):
        source = ROOT / relative
        if source.is_file() and "__pycache__" not in source.parts:
            (copy / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / relative)
    return copy


@pytest.fixture(scope="module")
def build_script(checkout):
    """Runs the frozen copy's docker/build.py, labelled with the real checkout's revision."""
    build = load_build_module()
    revision = build.git_revision()
    env = {**os.environ, "PTBR_BUILD_CACHE": str(build.CACHE)}

    def run(*args: str) -> subprocess.CompletedProcess:
        if args[0] == "build":
            args = (*args, "--revision", revision)
        result = subprocess.run([sys.executable, str(checkout / "docker" / "build.py"), *args],
                                capture_output=True, text=True, timeout=900, env=env)
        assert result.returncode == 0, (f"build.py {' '.join(args)} failed:\n"
                                        f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
        return result

    return run


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A podman store of the test's own, so no other image on the machine is touched."""
    missing = [tool for tool in ("podman", "buildah") if not shutil.which(tool)]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (apt-get install podman buildah runc debootstrap)")
    if os.geteuid() != 0:
        pytest.skip("the image test runs podman as root (as CI does)")
    store = tmp_path_factory.mktemp("podman-store")
    yield store
    subprocess.run([*podman(store), "system", "reset", "--force"], capture_output=True)
    shutil.rmtree(store, ignore_errors=True)
    command = podman(store)
    shutil.rmtree(command[command.index("--runroot") + 1], ignore_errors=True)


@pytest.fixture(scope="module")
def image_id(store, build_script, tmp_path_factory) -> str:
    """ptbr-cpu built from nothing in the test's store (the wheelhouse and the debootstrap base are
    cached under .cache/docker between runs; each CI run makes them afresh)."""
    iidfile = tmp_path_factory.mktemp("iid") / "first"
    started = time.monotonic()
    build_script("build", "cpu", "--tool", "podman", "--store", str(store), "--iidfile", str(iidfile))
    print(f"first build: {time.monotonic() - started:.0f} s")
    return iidfile.read_text().strip()


@pytest.mark.container
@pytest.mark.slow
def test_ptbr_smoke_passes_inside_the_image(store, image_id, build_script):
    result = build_script("smoke", "cpu", "--tool", "podman", "--store", str(store))
    assert "smoke ok" in result.stdout, result.stdout[-4000:]


@pytest.mark.container
@pytest.mark.slow
def test_image_metadata(store, image_id):
    inspect = subprocess.run([*podman(store), "image", "inspect", image_id], capture_output=True,
                             text=True, check=True)
    (image,) = json.loads(inspect.stdout)
    config = image["Config"]
    assert config["User"] == "ptbr"
    assert config["Entrypoint"] == ["ptbr"]
    assert set(config["Volumes"]) == {"/data", "/out"}
    assert config["StopSignal"] == "SIGINT"
    labels = config["Labels"]
    assert labels["org.opencontainers.image.version"] == re.search(
        r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    assert re.fullmatch(r"([0-9a-f]{40}|unknown)(-dirty)?", labels["org.opencontainers.image.revision"])
    assert labels["org.opencontainers.image.title"] == "ptbr-cpu"
    env = "\n".join(config["Env"])
    assert not re.search(r"(TOKEN|PASSWORD|SECRET|KAGGLE_KEY)=", env), "no credentials in the image"
    assert image["Size"] < 2.5e9, f"the CPU image grew to {image['Size'] / 1e9:.2f} GB"


@pytest.mark.container
@pytest.mark.slow
def test_stop_saves_a_checkpoint_and_exits_130(store, image_id, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.chown(out, 1000, 1000)  # the image's user, as the README tells users to do
    name = f"ptbr-stop-test-{os.getpid()}"
    subprocess.run(
        [*podman(store), "run", "-d", "--name", name, *PODMAN_RUN, "--network", "none",
         "-v", f"{out}:/out", image_id, "train", "--data", IMAGE_SAMPLE, "--output", "/out/run",
         "--model-size", "tiny", "--seq-len", "64", "--batch-size", "2", "--max-steps", "100000",
         "--save-every", "100000", "--eval-every", "0", "--log-every", "1"],
        check=True, capture_output=True)
    try:
        deadline = time.monotonic() + 180
        logs = ""
        while "step 1/" not in logs and time.monotonic() < deadline:
            time.sleep(1)
            logs = container_logs(store, name)
        assert "step 1/" in logs, f"training never reached a step:\n{logs[-3000:]}"
        subprocess.run([*podman(store), "stop", "--time", "120", name], check=True, capture_output=True)
        exit_code = subprocess.run([*podman(store), "inspect", "--format", "{{.State.ExitCode}}", name],
                                   capture_output=True, text=True, check=True).stdout.strip()
        logs = container_logs(store, name)
    finally:
        subprocess.run([*podman(store), "rm", "--force", "--volumes", name], capture_output=True)
    assert exit_code == "130", logs[-3000:]
    checkpoints = sorted((out / "run" / "checkpoints").glob("step_*/trainer_state.json"))
    assert checkpoints, f"no checkpoint after the stop:\n{logs[-3000:]}"


@pytest.mark.container
@pytest.mark.slow
def test_the_container_memory_limit_is_the_ram_ptbr_plans_with(store, image_id):
    """Under `--memory 1536m --cpus 1` ptbr reads the container's cgroup limits, not the host's RAM
    and cores: preflight names them, and a run with --auto-fit plans within the memory limit, fits
    torch's threads to the CPU quota and trains."""
    run = [*podman(store), "run", "--rm", *PODMAN_RUN, "--network", "none", "--memory", "1536m", "--cpus", "1",
           image_id]
    done = subprocess.run([*run, "preflight", "--model-size", "tiny", "--data", IMAGE_SAMPLE], capture_output=True,
                          text=True, timeout=300)
    assert re.search(r"hardware\.ram +RAM \(the container's memory limit\) [\d.]+ (GiB|MiB) available of "
                     r"1\.5 GiB\n", done.stdout), done.stdout + done.stderr
    assert re.search(r"hardware\.os .*, 1 CPU core\n", done.stdout), done.stdout
    done = subprocess.run([*run, "train", "--data", IMAGE_SAMPLE, "--output", "/tmp/run", "--model-size", "tiny",
                           "--max-steps", "2", "--eval-every", "0", "--auto-fit"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "done: 2 steps" in done.stderr + done.stdout, done.stderr[-3000:]
    # torch's own thread count there without the quota (its default: the physical cores it sees)
    threads = subprocess.run([*podman(store), "run", "--rm", *PODMAN_RUN, "--network", "none", "--entrypoint",
                              "/opt/ptbr/bin/python", image_id, "-c", "import torch; print(torch.get_num_threads())"],
                             capture_output=True, text=True, timeout=300, check=True).stdout.strip()
    if int(threads) > 1:  # one thread for the one CPU the quota gives
        assert f"torch: 1 CPU thread, not {threads}: this process may use 1 CPU " in done.stderr, done.stderr


@pytest.mark.container
@pytest.mark.slow
def test_files_the_images_user_cannot_read_or_write_are_one_line(store, image_id, tmp_path):
    """The image runs as uid 1000; a host's files are another user's (transformers saves weights
    0600): a dataset it cannot read was "a bug in ptbr" (exit 1), an --output it cannot write was
    told to choose another path, which does not help there."""
    data = tmp_path / "data"
    shutil.copytree(ROOT / "ptbr" / "data" / "sample", data, ignore=shutil.ignore_patterns("__*"))
    (data / "train.bin").chmod(0o600)  # root's
    out = tmp_path / "out"
    out.mkdir()  # root's, 0755
    run = [*podman(store), "run", "--rm", *PODMAN_RUN, "--network", "none", "-v", f"{data}:/data:ro", "-v",
           f"{out}:/out", image_id]
    done = subprocess.run([*run, "info", "--data", "/data"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 3 and done.stderr.strip() == (
        "error: cannot read train.bin: permission denied (/data); fix: the ptbr-cpu image runs as uid 1000: on the "
        'host, make the files readable by it (chmod -R a+rX FOLDER), or run the container as yourself (--user '
        '"$(id -u):$(id -g)")'), done.stderr
    (data / "train.bin").chmod(0o644)
    done = subprocess.run([*run, "train", "--data", "/data", "--output", "/out/run", "--max-steps", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 6 and done.stderr.strip().splitlines()[-1] == (
        "error: cannot create or write the output directory: Permission denied (/out/run); fix: the ptbr-cpu image "
        "runs as uid 1000: on the host, give it the mounted folder (chown 1000:1000 FOLDER), or run the container "
        'as yourself (--user "$(id -u):$(id -g)")'), done.stderr


@pytest.mark.container
@pytest.mark.slow
def test_rebuild_from_scratch_gives_the_same_image_id(store, image_id, build_script, tmp_path):
    iidfile = tmp_path / "second"
    started = time.monotonic()
    build_script("build", "cpu", "--tool", "podman", "--store", str(store), "--no-cache",
                 "--iidfile", str(iidfile))
    print(f"rebuild with --no-cache: {time.monotonic() - started:.0f} s")
    second = iidfile.read_text().strip()
    if second != image_id:
        pytest.fail("two builds of one checkout differ:\n" + "\n".join(
            describe(store, image) for image in (image_id, second)))


def describe(store: Path, image: str) -> str:
    """An image's layers and build steps, to see where two builds part."""
    inspect = subprocess.run([*podman(store), "image", "inspect", "--format",
                              "{{json .RootFS.Layers}}", image], capture_output=True, text=True)
    history = subprocess.run([*podman(store), "history", "--no-trunc", "--format",
                              "{{.Size}} {{.CreatedBy}}", image], capture_output=True, text=True)
    return f"{image}\n  layers {inspect.stdout.strip()}\n  " + "\n  ".join(
        line[:300] for line in history.stdout.splitlines() if not line.startswith("0 B"))
