"""Benchmark cells as Ray tasks: the grid on a cluster (``aqr bench --executor ray``; needs ``aqr[ray]``).

Each cell is a Ray task holding ``cpus_per_cell`` CPUs and ``gpus_per_cell`` GPUs; Ray reruns it
(at most ``max_retries`` times) when its worker process dies, and a cell that dies every time comes
back as an ``error`` result naming Ray's error. The driver (the process in
:func:`aqr.harness.grid_driver.run_grid`) only hashes files, schedules and writes the database:

- source statistics are computed once per statistics file, as Ray tasks; the driver stores them
  in its cache folder (a rerun reuses them) and shares them through the object store, and each
  node writes them once into its temporary folder, named by their content hash;
- the data files must be readable at the same paths on every node (a shared filesystem): before
  the first cell a small task on each node that can run cells checks every file and its size.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from aqr.harness.cells import Cell, CellResult
from aqr.harness.executors import CellSettings, run_cell_task
from aqr.harness.source_stats import compute_stats, stats_options
from aqr.util.files import atomic_write, sha256_file
from aqr.util.ownership import UntrustedPathError, private_folder, untrusted_reason

# The aqr package folder this driver runs, shipped to the nodes with ship_code.
AQR_PACKAGE = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class RayOptions:
    """How cells run on Ray.

    Attributes:
        address: the cluster: ``None`` lets Ray choose (``RAY_ADDRESS``, else a cluster started on
            this machine with ``ray start``, else a new local instance), ``"auto"`` an existing
            cluster only, ``"HOST:PORT"`` that head node. Ignored if this process is already
            connected (``ray.init`` was called).
        cpus_per_cell: CPUs Ray reserves for one cell (a cell's default thread count).
        gpus_per_cell: GPUs Ray reserves for one cell (fractions share a GPU); > 0 runs cells on CUDA.
        max_retries: reruns of a cell whose worker process died, before it is an ``error`` row.
        ship_code: run the driver's own ``aqr`` package on the nodes (the job's ``py_modules``
            runtime environment), so that every row is computed by the code its provenance names;
            the nodes still need aqr's dependencies (torch, numpy, safetensors, ...). ``False``:
            the nodes import the aqr they have installed. Applies when this executor connects
            (Ray allows it only in ``ray.init``); a process already connected keeps its job's.
        init: further ``ray.init`` arguments when a new local instance starts (``num_cpus``,
            ``object_store_memory``, ...).
    """

    address: str | None = None
    cpus_per_cell: float = 1.0
    gpus_per_cell: float = 0.0
    max_retries: int = 2
    ship_code: bool = True
    init: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.cpus_per_cell < math.inf:
            raise ValueError(f"cpus_per_cell must be a finite positive number, got {self.cpus_per_cell}")
        if not 0 <= self.gpus_per_cell < math.inf:
            raise ValueError(f"gpus_per_cell must be a finite number >= 0, got {self.gpus_per_cell}")
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {self.max_retries!r}")


CONNECT_TIMEOUT_S = 20.0  # how long an explicit --ray-address may take to accept a connection


def check_reachable(address: str | None, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Raise ``ConnectionError`` within ``timeout`` seconds when an explicit ``host:port`` (or
    ``ray://host:port``) address accepts no TCP connection; Ray itself would retry for many minutes.
    ``None``, ``auto`` and ``local`` are Ray's to resolve."""
    import socket

    if not address or address in ("auto", "local"):
        return
    where = address.split("://", 1)[-1]
    host, sep, port = where.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--ray-address {address!r} must be host:port, ray://host:port, auto or local")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as err:
        raise ConnectionError(f"cannot reach the Ray cluster at {address} ({err.strerror or err})") from None


def import_ray() -> Any:
    """The ``ray`` module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as err:
        raise ImportError("the Ray executor needs Ray: pip install 'aqr[ray]'") from err
    return ray


def node_cache() -> Path:
    """This node's folder for statistics received from the driver: one per user (``aqr-ray-<uid>`` in the
    temporary folder, created ``0700``); where that name is another user's or writable by others, a private
    folder of this process (:func:`aqr.util.ownership.private_folder`)."""
    try:
        return private_folder(Path(tempfile.gettempdir()) / f"aqr-ray-{os.geteuid()}")
    except UntrustedPathError:
        return Path(tempfile.mkdtemp(prefix="aqr-ray-"))


#: a statistics file's name on the nodes: the first 24 hex digits of its SHA-256 (``prepare_stats``)
NODE_STATS_NAME = re.compile(r"([0-9a-f]{24})\.aqr\.safetensors")


def node_stats_file(cache: Path, name: str, fetch: Callable[[], bytes]) -> Path:
    """The statistics file ``name`` in the node cache ``cache``, used only if it is this user's alone and its
    SHA-256 starts with the digits its name carries; otherwise written again from ``fetch()`` (the driver's
    bytes), which must match them too."""
    match = NODE_STATS_NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"not a node statistics file name: {name!r}")
    path = private_folder(cache / "stats") / name
    if path.is_file() and untrusted_reason(path) is None and sha256_file(path).startswith(match[1]):
        return path
    data = fetch()
    if not hashlib.sha256(data).hexdigest().startswith(match[1]):
        raise ValueError(f"the statistics sent for {name} do not have the SHA-256 their name carries")
    atomic_write(path, lambda tmp: tmp.write_bytes(data))
    return path


# ----------------------------------------------------------------------------- what runs on the nodes


def _cell_task(cell_dict: dict, stats: tuple[str, list] | None, settings: CellSettings) -> CellResult:
    """One cell on a node; ``stats``: (file name, [object ref of its bytes]), written here once per node.

    The result's ``node`` is ``host/Ray node id`` (several nodes may share a host).
    """
    import ray

    stats_file = None
    cache = node_cache()
    if stats is not None:
        name, (ref,) = stats  # the ref is wrapped in a list so that Ray ships the bytes only when needed
        stats_file = node_stats_file(cache, name, lambda: ray.get(ref))
    result = run_cell_task(cell_dict, str(cache), None if stats_file is None else str(stats_file), settings)
    return replace(result, node=f"{result.node}/{ray.get_runtime_context().get_node_id()[:12]}")


def _stats_task(cell_dict: dict, settings: CellSettings) -> bytes:
    """The safetensors bytes of a cell's source statistics, computed on a node."""
    folder = Path(tempfile.mkdtemp(prefix="aqr-stats-"))
    try:
        stats = compute_stats(Cell.from_dict(cell_dict), device=settings.device,
                              loader_workers=settings.loader_workers, threads=settings.threads)
        path = stats.save(folder / "stats.aqr.safetensors")
        return path.read_bytes()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _check_files_task(sizes: dict[str, int]) -> list[str]:
    """What is wrong with the files on this node: unreadable, or of another size than the driver's
    (size -1: a folder, which must be readable and not empty)."""
    problems = []
    for path, size in sizes.items():
        try:
            if size < 0:
                with os.scandir(path) as entries:
                    if next(entries, None) is None:
                        problems.append(f"{path} is an empty folder there")
                continue
            with open(path, "rb") as f:
                f.read(1)
            found = os.stat(path).st_size
        except OSError as err:
            problems.append(f"cannot read {path} ({err.strerror or err})")
            continue
        if found != size:
            problems.append(f"{path} has {found} bytes there, {size} on the driver")
    return problems


# ----------------------------------------------------------------------------- the driver's side


class RayExecutor:
    """Runs cells as Ray tasks (see the module docs); connects to Ray, or starts it, on creation.

    ``settings``: how each cell runs; its threads default to ``cpus_per_cell`` rounded up, its
    device to CUDA when cells get GPUs (a CUDA device without GPUs per cell is refused).
    """

    name = "ray"

    def __init__(self, cache_dir: str | Path, options: RayOptions, settings: CellSettings = CellSettings(),
                 progress: bool = True, log: Callable[[str], None] = print) -> None:
        self.ray = ray = import_ray()
        self.options = options
        self.cache_dir = Path(cache_dir)
        device = settings.device or ("cuda" if options.gpus_per_cell > 0 else None)
        if str(device).startswith("cuda") and options.gpus_per_cell <= 0:
            raise ValueError(f"device {device!r} under Ray needs GPUs per cell (--gpus-per-cell), or Ray "
                             "schedules cells where no GPU is reserved for them")
        self.settings = replace(settings, threads=settings.threads or max(1, math.ceil(options.cpus_per_cell)),
                                device=device)
        self.log = log
        self._owns = not ray.is_initialized()
        if self._owns:
            init = dict(options.init)
            if options.ship_code:
                init.setdefault("runtime_env", {"py_modules": [str(AQR_PACKAGE)],
                                                "excludes": ["__pycache__"]})
            check_reachable(options.address)
            try:
                ray.init(address=options.address, **init)
            except ConnectionError as err:
                raise ConnectionError(f"{err}; a cluster with token authentication also needs RAY_AUTH_MODE=token "
                                      "and its token (~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)") from err
        resources = {"num_cpus": options.cpus_per_cell, "num_gpus": options.gpus_per_cell}
        self._cell = ray.remote(_cell_task).options(max_retries=options.max_retries, retry_exceptions=False,
                                                    **resources)
        self._stats = ray.remote(_stats_task).options(max_retries=options.max_retries, **resources)
        self._check = ray.remote(_check_files_task)
        self._outstanding: set[Any] = set()
        self._slots: tuple[float, int] = (-math.inf, 1)

    # ---- resources --------------------------------------------------------------------------
    def _fits(self, resources: Mapping[str, float]) -> bool:
        return (resources.get("CPU", 0) >= self.options.cpus_per_cell
                and resources.get("GPU", 0) >= self.options.gpus_per_cell)

    def _nodes(self) -> list[dict]:
        return [n for n in self.ray.nodes() if n.get("Alive") and self._fits(n.get("Resources", {}))]

    def capacity(self) -> int:
        """Twice the cells the cluster can run at once (read again every 10 s: nodes come and go)."""
        checked, slots = self._slots
        if time.monotonic() - checked > 10:
            total = self.ray.cluster_resources()
            slots = int(total.get("CPU", 0) // self.options.cpus_per_cell)
            if self.options.gpus_per_cell > 0:
                slots = min(slots, int(total.get("GPU", 0) // self.options.gpus_per_cell))
            self._slots = (time.monotonic(), slots)
        return max(1, 2 * slots)

    # ---- before the first cell -------------------------------------------------------------------
    def check_files(self, sizes: Mapping[Path, int]) -> None:
        """Run :func:`_check_files_task` on every node that can run a cell; raise on the first problem."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = self._nodes()
        if not nodes:
            raise ValueError(f"no node of the Ray cluster offers {self.options.cpus_per_cell:g} CPUs and "
                               f"{self.options.gpus_per_cell:g} GPUs to one cell (cluster: "
                               f"{self.ray.cluster_resources()})")
        wanted = {str(path): int(size) for path, size in sizes.items()}
        checks = {self._check.options(num_cpus=0, max_retries=0,
                                      scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                  .remote(wanted): n for n in nodes}
        for ref, node in checks.items():
            problems = self.ray.get(ref)
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                raise FileNotFoundError(
                    f"node {node.get('NodeManagerHostname')} ({node.get('NodeManagerAddress')}): {problems[0]}{more}; "
                    "every node must read the data at the same paths as the driver (a shared filesystem)")

    def prepare_stats(self, needed: Mapping[Path, Cell]) -> dict[Path, Any]:
        """Statistics from the driver's cache, or computed once per file on the cluster (in parallel)."""
        refs: dict[Path, Any] = {}
        data: dict[Path, bytes] = {}
        for path, cell in needed.items():
            if path.is_file():
                data[path] = path.read_bytes()
                refs[path] = self.ray.put(data[path])
            else:
                self.log(f"calibrating {cell.model.name} (K={stats_options(cell)['K']}) on the cluster -> {path}")
                refs[path] = self._stats.remote(cell.to_dict(), self.settings)
        for path, ref in refs.items():
            if path not in data:
                data[path] = self.ray.get(ref)  # a failed calibration raises its own error, as locally
                atomic_write(path, lambda tmp, blob=data[path]: tmp.write_bytes(blob))
        return {path: (f"{hashlib.sha256(data[path]).hexdigest()[:24]}.aqr.safetensors", [ref])
                for path, ref in refs.items()}

    # ---- cells ------------------------------------------------------------------------------
    def submit(self, cell: Cell, stats: Any | None) -> Hashable:
        ref = self._cell.remote(cell.to_dict(), stats, self.settings)
        self._outstanding.add(ref)
        return ref

    def wait(self, handles: Sequence[Hashable], timeout: float) -> list[tuple[Hashable, CellResult]]:
        ready, _ = self.ray.wait(list(handles), num_returns=1, timeout=timeout)
        if ready:  # and whatever else has finished by now
            ready, _ = self.ray.wait(list(handles), num_returns=len(handles), timeout=0)
        out = []
        for ref in ready:
            self._outstanding.discard(ref)
            try:
                result = self.ray.get(ref)
            except self.ray.exceptions.RayError as err:  # the worker died on every try, or Ray failed
                first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                result = CellResult("error", message=f"{type(err).__name__} (after {self.options.max_retries} "
                                                     f"retries): {first}\n{err}")
            out.append((ref, result))
        return out

    def close(self) -> None:
        """Cancel the cells still queued or running, and stop Ray if this executor started it."""
        for ref in self._outstanding:
            self.ray.cancel(ref, force=True)
        self._outstanding.clear()
        if self._owns:
            self.ray.shutdown()
