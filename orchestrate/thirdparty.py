"""Every place orchestrate reaches into another library's internals, in one file: each patch of a
private attribute and each import of a private module, as a named function that says why there is
no public way, and `INTERNALS`, the private names they touch. tests/test_thirdparty.py finds each
of those names in the pinned versions (constraints.txt), so that a pin that moves and drops one
fails there first, naming the function here that needs it; and it reads the package's sources so
that no other module reaches into a private name. One named exception: the grid sweeper plugin
(hydra_plugins/orchestrate_grid_sweeper) subclasses Hydra's BasicSweeper, as a sweeper that
expands a grid the way Hydra's own does must.

Every library is imported inside the function that needs it: importing this module costs nothing.
"""

import contextlib
import importlib.util
import logging
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Internal:
    module: str  # the module, imported by the test
    name: str  # a dotted attribute path inside it ("": the module itself)
    used_by: str  # what of this module touches it
    instance: bool = False  # an attribute each instance sets (`self.<last part> =` in the module's source)


def _listed(by_user: dict[str, tuple[str, ...]]) -> tuple[Internal, ...]:
    """`INTERNALS` from `{what uses them: ("module:Attribute.path", ...)}`; a trailing `*` marks
    an attribute each instance sets, a bare module the module itself."""
    return tuple(Internal(spec.partition(":")[0], spec.partition(":")[2].rstrip("*"), user, spec.endswith("*"))
                 for user, specs in by_user.items() for spec in specs)


INTERNALS = _listed({
    # ORTModule: no option for its sessions' thread pools (ortmodule_session_options)
    "ortmodule_session_options": (
        "onnxruntime.training.ortmodule._graph_execution_manager:GraphExecutionManager._get_session_config",
        "onnxruntime.training.ortmodule._torch_module_ort:TorchModuleORT._execution_manager*",
        "onnxruntime.training.ortmodule.ortmodule:ORTModule._torch_module*",
    ),
    # ORTModule's symbolics, set aside around an export (standard_symbolics)
    "standard_symbolics": (
        "onnxruntime.training.ortmodule._custom_op_symbolic_registry:CustomOpSymbolicRegistry._SYMBOLICS",
        "torch.onnx._internal.registration:registry.get_function_group",
        "torch.onnx._internal.registration:_SymbolicFunctionGroup",
    ),
    # Ray Train's fit() installs its own SIGINT handler (ray_train_signals_to)
    "ray_train_signals_to": ("ray.train.v2.api.data_parallel_trainer:DataParallelTrainer._register_sigint_handler",),
    # Ray Train's per-report INFO line, logged under its module's file name (quiet_ray_train_reports)
    "quiet_ray_train_reports": ("ray.train.v2._internal.execution.context",),
    # Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, at import (ray_local_only)
    "ray_local_only": ("ray._private.ray_constants:ENABLE_RAY_CLUSTER",),
    "RAY_EARLY_LOGGERS": ("ray._private.worker",),
    # the worker output Ray prints on the driver (tap_ray_worker_output)
    "tap_ray_worker_output": (
        "ray._private.ray_logging:global_worker_stdstream_dispatcher",
        "ray._private.ray_logging:stdout_deduplicator",
        "ray._private.ray_logging:stderr_deduplicator",
        "ray._private.worker:print_worker_logs",
    ),
    # Optuna's own loop state, kept by an asynchronous loop of ours (optuna_optimize_loop)
    "optuna_optimize_loop": (
        "optuna.study.study:Study._stop_flag*",
        "optuna.study.study:Study._thread_local*",
    ),
    # Optuna's gRPC storage proxy, started and stopped by its owner (optuna_grpc_proxy)
    "optuna_grpc_proxy": (
        "optuna.storages._grpc.servicer:OptunaStorageProxyService",
        "optuna.storages._grpc.auto_generated.api_pb2_grpc:add_StorageServiceServicer_to_server",
    ),
    # the thread count Inductor writes into its C++ kernels (inductor_kernel_threads)
    "inductor_kernel_threads": ("torch._inductor.config:cpp.threads",),
    # torch names its exporter's opsets nowhere public (torch_onnx_opsets)
    "torch_onnx_opsets": (
        "torch.onnx._constants:ONNX_MIN_OPSET",
        "torch.onnx._constants:ONNX_MAX_OPSET",
    ),
    # a cluster's metadata read from its GCS, as ray.init reads it first (ray_cluster_metadata)
    "ray_cluster_metadata": ("ray._raylet:GcsClient",),
    # what `auto` names, as ray.init resolves it (ray_auto_address)
    "ray_auto_address": ("ray._private.services:canonicalize_bootstrap_address",),
    # MLflow: an empty store's tables made once and copied, its stores' URI schemes
    "mlflow_initialize_tables": ("mlflow.store.db.utils:_initialize_tables",),
    "mlflow_store_schemes": ("mlflow.tracking._tracking_service.utils:_tracking_store_registry._registry",),
    # MLflow's ONNX flavor imports onnxruntime to check session options none are given (onnx_flavor_without_runtime)
    "onnx_flavor_without_runtime": ("mlflow.onnx:_validate_onnx_session_options",),
    # submitit's one watcher of Slurm's queue, for all its jobs (submitit_slurm_watcher)
    "submitit_slurm_watcher": ("submitit.slurm.slurm:SlurmJob.watcher",),
    "submitit_watch_delay_s": ("submitit.core.core:InfoWatcher._delay_s*",),
    # Hydra: its argument parser, its config loading outside @hydra.main (hydra_internals)
    "hydra_internals": (
        "hydra._internal.utils:get_args_parser",
        "hydra._internal.utils:create_automatic_config_search_path",
        "hydra._internal.hydra:Hydra.create_main_hydra2",
        "hydra._internal.config_loader_impl:ConfigLoaderImpl",
    ),
    "job_error": ("hydra.core.utils:JobReturn._return_value",),
    # Hydra's composition steps that a sweep's Composer repeats per trial (hydra_caching_repo, hydra_apply_overrides)
    "hydra_caching_repo": ("hydra._internal.config_loader_impl:ConfigLoaderImpl._parse_overrides_and_create_caching_repo",),
    "hydra_apply_overrides": ("hydra._internal.config_loader_impl:ConfigLoaderImpl._apply_overrides_to_config",),
    # argparse lists a parser's options nowhere public (option_strings)
    "option_strings": ("argparse:_ActionsContainer._actions*",),
    # logging keeps whether it captures warnings in a module global (captures_warnings)
    "captures_warnings": ("logging:_warnings_showwarning",),
    # what the interpreter does at exit before it frees its modules (exit_work: a fork of the warm pool)
    "exit_work": ("threading:_shutdown", "atexit:_run_exitfuncs"),
    # MLflow's own checks of names, run only once it is handed them (mlflow_name_checks)
    "mlflow_name_checks": ("mlflow.utils.validation:_validate_tag_name",
                           "mlflow.utils.validation:_validate_model_name"),
    # a dataset as the entity MlflowClient.log_inputs takes (mlflow_dataset_entity)
    "mlflow_dataset_entity": ("mlflow.data.dataset:Dataset._to_mlflow_entity",),
    # an Optuna study's storage and ids, which a trial outside Study.optimize needs (optuna_storage, ...)
    "optuna_storage": ("optuna.study.study:Study._storage*",),
    "optuna_trial_id": ("optuna.study.study:Study._study_id*", "optuna.trial._trial:Trial._trial_id*"),
    # ORT's C value under an OrtValue, what Module.copy_buffer_to_parameters takes (ort_c_value)
    "ort_c_value": ("onnxruntime.capi.onnxruntime_inference_collection:OrtValue._ortvalue*",),
    # the shape inference ORTModule runs on its export, repeated by its check (ortmodule_shape_inference)
    "ortmodule_shape_inference": (
        "onnxruntime.training.ortmodule._graph_transition_manager:GraphTransitionManager._infer_shapes",),
    # ORTModule's logger, which its options set (ortmodule_logger)
    "ortmodule_logger": ("onnxruntime.training.ortmodule.ortmodule:ORTModule._logger*",),
    # Hydra's own sweeper and launcher, named as config targets (GRID_SWEEPER, BASIC_LAUNCHER)
    "GRID_SWEEPER": ("hydra._internal.core_plugins.basic_sweeper:BasicSweeper",),
    "BASIC_LAUNCHER": ("hydra._internal.core_plugins.basic_launcher:BasicLauncher",),
})

# Hydra's basic sweeper and launcher as their `_target_`s: config values, which Hydra's configs
# give in these words.
GRID_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"  # runs each job in this process
# Ray's loggers whose notes (a SIGTERM handler not set, token authentication on) a Ray started on
# another thread logs.
RAY_TOKEN_SETUP_LOGGER = "ray._private.authentication.authentication_token_setup"
RAY_EARLY_LOGGERS = ("ray._private.worker", RAY_TOKEN_SETUP_LOGGER)


# ---- ONNX Runtime and torch.onnx ---------------------------------------------------------------

def ortmodule_session_options(wrapped, configure: Callable[[Any], None]) -> None:
    """`configure(options)` on the SessionOptions each of an ORTModule's graph managers (training
    and inference) builds. ORTModule has no public option for its sessions' threads: its managers'
    `_get_session_config` is extended, on this ORTModule only."""
    factory = wrapped._torch_module._execution_manager
    for manager in (factory._training_manager, factory._inference_manager):
        original = manager._get_session_config

        def extended(self_, original=original):
            options, providers, provider_options = original()
            configure(options)
            return options, providers, provider_options

        manager._get_session_config = types.MethodType(extended, manager)


@contextlib.contextmanager
def standard_symbolics() -> Iterator[None]:
    """torch.onnx's own symbolic functions meanwhile. An ORTModule, once built, registers ORT's
    symbolics with torch.onnx for the rest of the process (MaxPool2d, embedding, ... as `ATen`
    nodes of the org.pytorch.aten domain, which only ORTModule's own sessions run) and never
    removes them: any export after it (the trained model for inference, the on-device API's
    training graph, another backend's run in the same process) would carry those nodes, and
    ORT's inference sessions refuse to load the model. They are set aside here and put back after,
    for the ORTModules still alive. torch.onnx can register and unregister a custom symbolic, but
    not say whether one is registered at an opset: its registry (a private module) is read."""
    registry = sys.modules.get("onnxruntime.training.ortmodule._custom_op_symbolic_registry")
    if registry is None:  # no ORTModule in this process: nothing registered
        yield
        return
    from torch.onnx import register_custom_op_symbolic, unregister_custom_op_symbolic
    from torch.onnx._internal import registration

    set_aside = []
    for name in registry.CustomOpSymbolicRegistry._SYMBOLICS:
        name = f"aten{name}" if name.startswith("::") else name  # as torch.onnx stores "::op"
        group = registration.registry.get_function_group(name)
        for opset in range(1, 100) if group is not None else ():
            if group._functions.overridden(opset):
                set_aside.append((name, group._functions[opset], opset))
                unregister_custom_op_symbolic(name, opset)
    try:
        yield
    finally:
        for name, function, opset in set_aside:
            register_custom_op_symbolic(name, function, opset)


@contextlib.contextmanager
def inductor_kernel_threads(threads: int) -> Iterator[None]:
    """While the block runs, TorchInductor compiles its CPU kernels for `threads` OpenMP threads (0:
    torch's thread count at compile time, its default). It writes the count into each kernel
    (`#pragma omp parallel num_threads(N)`) and its cache does not key on torch's count: a kernel
    compiled earlier for 2 threads runs 2 in a run sized for 1. Its config option keys the cache
    too; torch.compile takes no public option for it."""
    from torch._inductor import config

    with config.patch({"cpp.threads": threads or -1}):
        yield


def torch_onnx_opsets() -> tuple[int, int]:
    """The lowest and highest opset torch's exporter knows: torch names them nowhere public."""
    from torch.onnx import _constants

    return _constants.ONNX_MIN_OPSET, _constants.ONNX_MAX_OPSET


def ort_c_value(value):
    """The C value under an `OrtValue` (what the on-device API's `Module.copy_buffer_to_parameters`
    takes: its Python wrapper passes it on as it is)."""
    return value._ortvalue


def ortmodule_shape_inference(exported: bytes) -> None:
    """ORT's symbolic shape inference on an exported model, with the settings ORTModule gives it
    after its own export (GraphTransitionManager._infer_shapes); raises what it raises. ORTModule
    runs it on the first step, inside the run, and a model it fails on fails there."""
    import onnx
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    SymbolicShapeInference.infer_shapes(onnx.load_from_string(exported), auto_merge=True, guess_output_rank=True)


def ortmodule_logger(wrapped) -> logging.Logger:
    """An ORTModule's logger: its banner and the exporter's warnings (which it collects from the
    export) go there, at a level only its debug options set."""
    return wrapped._logger


def fused_step(optimizer, found_inf) -> None:
    """One step of a fused optimizer (`fused=True`) that the device flag `found_inf` (a tensor,
    nonzero: skip) skips on the device, its step count too: torch's GradScaler hands a fused
    optimizer `grad_scale` and `found_inf` as attributes for the step (their protocol, public
    nowhere), and takes them away after it."""
    optimizer.grad_scale, optimizer.found_inf = None, found_inf
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf


# ---- Ray and Ray Train ---------------------------------------------------------------------------

def ray_train_signals_to(trainer, take: Callable[[Any], None]) -> None:
    """Ray Train's `fit()` takes over SIGINT (its handler asks the controller to abort, then
    exits with SystemExit) and has no option against it: its registration is replaced, on this
    trainer, by `take`, which is handed the controller actor instead."""
    trainer._register_sigint_handler = take


def ray_local_only() -> None:
    """Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when it is imported: in a process that
    imported ray before, the setting is made where Ray keeps what it read (so that a local Ray
    does not register the machine's network address). For this process, as the variable says."""
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def tap_ray_worker_output(take_markers: Callable[[list[str]], tuple[list[str], list[str]]],
                          saw: Callable[[list[str]], None]) -> Optional[Callable[[], None]]:
    """Ray offers no public hook on the worker output it prints on the driver. Its print thread
    hands each batch of lines (a dict: "lines", "pid", "is_err", ...) to the handlers of
    `ray._private.ray_logging.global_worker_stdstream_dispatcher`; the one named "ray_print_logs"
    prints them (through its log deduplicator). That handler is wrapped: markers are taken out of
    a batch before it is printed, and reported once it has been. Returns the function that puts
    the handler back (printing what the deduplicator still holds, as `ray.shutdown()` would), or
    None when there is nothing to tap (this driver prints no worker output, or Ray's internals
    have changed: then the caller does not wait for markers)."""
    try:
        from ray._private import ray_logging

        dispatcher = ray_logging.global_worker_stdstream_dispatcher
        with dispatcher._lock:
            printer = dict(dispatcher.handlers).get("ray_print_logs")
            if printer is None:
                return None

            def print_batch(data: dict[str, Any]) -> None:
                data["lines"], found = take_markers(data.get("lines") or [])
                printer(data)
                if found:
                    saw(found)

            dispatcher.handlers = [(n, print_batch if n == "ray_print_logs" else h) for n, h in dispatcher.handlers]
    except (ImportError, AttributeError, TypeError):
        return None

    def release() -> None:
        # What the deduplicator holds is printed as ray.shutdown() prints it: straight to the
        # stream (handed to `printer` it went back into the deduplicator, to be printed only
        # when this process's Ray shut down, after whatever the caller printed next).
        from ray._private.worker import print_worker_logs

        with dispatcher._lock:
            dispatcher.handlers = [(n, printer if h is print_batch else h) for n, h in dispatcher.handlers]
            for dedup, sink in ((ray_logging.stdout_deduplicator, sys.stdout),
                                (ray_logging.stderr_deduplicator, sys.stderr)):
                for held in dedup.flush():
                    print_worker_logs(held, sink)
                sink.flush()

    return release


def ray_auto_address() -> str | None:
    """The host:port `ray.init(address="auto")` would join (RAY_ADDRESS, else the cluster started
    on this machine last), or None where there is none: Ray resolves `auto` nowhere public. Its
    note on finding several Ray instances is left out (the one it chose is what the caller checks)."""
    from ray._private import services

    logger = logging.getLogger(services.__name__)
    level, logger.level = logger.level, logging.ERROR
    try:
        return services.get_ray_address_from_environment("auto", None)
    except (ConnectionError, ValueError):
        return None
    finally:
        logger.setLevel(level)


def ray_cluster_metadata(hostport: str, timeout_s: float) -> bytes | None:
    """The cluster's metadata as its GCS holds it (what `ray.init` reads first), with this
    process's token; Ray has no public client for one read without joining the cluster."""
    from ray._raylet import GcsClient

    return GcsClient(address=hostport).internal_kv_get(b"CLUSTER_METADATA", namespace=b"cluster", timeout=timeout_s)


def quiet_ray_train_reports() -> None:
    """Ray Train's worker context logs a console line per `ray.train.report` at INFO: WARNING up.
    Its logger is named after the module's file (`logging.getLogger(__file__)`), not its module."""
    from ray.train.v2._internal.execution import context

    logging.getLogger(context.__file__).setLevel(logging.WARNING)


# ---- Optuna ----------------------------------------------------------------------------------------

def optuna_optimize_loop(study) -> Callable[[], bool]:
    """The state Study.optimize keeps while it runs, set for our own asynchronous loop (Optuna's
    runs one trial per thread and waits for each; it has no public way to run trials otherwise):
    samplers read `in_optimize_loop`, and a sampler may stop the study (GridSampler, once every
    point is taken) through its stop flag, which the returned function reads. Undone by
    `optuna_optimize_loop_end`, as `optimize` leaves it."""
    study._thread_local.in_optimize_loop, study._stop_flag = True, False
    return lambda: bool(study._stop_flag)


def optuna_optimize_loop_end(study) -> None:
    study._thread_local.in_optimize_loop = False


def optuna_grpc_proxy(storage, host: str):
    """(a gRPC server proxying `storage`, its thread pool, the port it took on `host`), not
    started. Optuna's public `run_grpc_proxy_server` serves until the process ends, on a port
    chosen before (none free is known then); its parts, as it assembles them, give a server
    that stops with the sweep, on a free port."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from optuna.storages._grpc.auto_generated.api_pb2_grpc import add_StorageServiceServicer_to_server
    from optuna.storages._grpc.servicer import OptunaStorageProxyService

    pool = ThreadPoolExecutor(max_workers=10, thread_name_prefix="optuna-grpc")
    server = grpc.server(pool)
    add_StorageServiceServicer_to_server(OptunaStorageProxyService(storage), server)
    return server, pool, server.add_insecure_port(f"{host}:0")


def optuna_storage(study):
    """The storage object a study reads and writes through (the one its cache is in)."""
    return study._storage


def optuna_trial_id(study, number: int | None = None, trial=None) -> int:
    """The storage's id of `trial`, or of the study's trial numbered `number` (a trial opened in
    another process, outside Study.optimize)."""
    if trial is not None:
        return trial._trial_id
    return study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)


# ---- submitit --------------------------------------------------------------------------------------

def submitit_slurm_watcher(watcher=None):
    """submitit's one watcher of Slurm's queue (a class attribute every SlurmJob asks), returned;
    replaced by `watcher` when one is given (put back by calling this again with the one
    returned). submitit has no option for how its jobs' states are read."""
    from submitit.slurm.slurm import SlurmJob

    previous = SlurmJob.watcher
    if watcher is not None:
        SlurmJob.watcher = watcher
    return previous


def submitit_watch_delay_s(watcher) -> float:
    """How long submitit's watcher waits between two reads of the queue."""
    return watcher._delay_s


# ---- Hydra -----------------------------------------------------------------------------------------

def hydra_internals() -> types.SimpleNamespace:
    """Hydra's parts that `@hydra.main` uses and its public API does not offer, to compose a config
    exactly as the run will (orchestrate.config) and to read the command line as it will
    (orchestrate.cli): its argument parser, the search path it builds for a config folder, its
    main object, and its config loader."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_automatic_config_search_path, get_args_parser

    return types.SimpleNamespace(get_args_parser=get_args_parser, Hydra=Hydra, ConfigLoaderImpl=ConfigLoaderImpl,
                                 create_automatic_config_search_path=create_automatic_config_search_path)


def job_error(ret) -> BaseException:
    """The exception a FAILED job's JobReturn holds: its public `return_value` raises it instead."""
    return ret._return_value


def hydra_caching_repo(config_name: str | None):
    """Hydra's config repository on the search path it builds for a composition of `config_name`
    (which the primary config's `hydra.searchpath` may extend), as `@hydra.main` builds it; Hydra
    initialized (orchestrate.config's `_hydra`)."""
    from hydra.core.global_hydra import GlobalHydra

    return GlobalHydra.instance().config_loader()._parse_overrides_and_create_caching_repo(config_name, [])[1]


def hydra_apply_overrides(overrides: list, cfg) -> None:
    """Hydra's own application of parsed value overrides (`key=value`, `+key=value`, `~key`) to a
    composed config, as its composition ends."""
    hydra_internals().ConfigLoaderImpl._apply_overrides_to_config(overrides, cfg)


def option_strings(parser) -> list[str]:
    """An argparse parser's options, each as "-s/--long"."""
    return ["/".join(a.option_strings) for a in parser._actions if a.option_strings]


# ---- the standard library ------------------------------------------------------------------------

def exit_work() -> None:
    """What Python does at exit before it tears its modules down: wait for the threads that are
    not daemons, then run the atexit functions (MLflow's and Ray's shutdowns, logging's flush,
    weakref finalizers). A fork of the warm pool does this, then leaves with os._exit: freeing
    thousands of modules it never owned would cost about a second and change nothing."""
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()


def captures_warnings() -> bool:
    """Whether `logging.captureWarnings(True)` is in force (logging keeps warnings' own
    showwarning while it is, and says so nowhere public)."""
    return logging._warnings_showwarning is not None


# ---- MLflow ----------------------------------------------------------------------------------------

def mlflow_initialize_tables(engine) -> None:
    """A new SQLite store's tables, made as MLflow makes them (orchestrate.tracking.stores keeps
    one empty store and copies it: MLflow's migrations take seconds per store)."""
    from mlflow.store.db.utils import _initialize_tables

    _initialize_tables(engine)


@contextlib.contextmanager
def onnx_flavor_without_runtime() -> Iterator[None]:
    """While the block runs, `mlflow.onnx.save_model` saves a model where no ONNX Runtime is
    installed (the base install: ORT is an extra, and the training build and the `onnxruntime`
    package cannot share an environment). It imports onnxruntime only to check the session
    options (`onnx_session_options`), which orchestrate never passes; serving the model needs a
    runtime, which the model's requirements name (MLflow's warning that this environment lacks
    it is left out meanwhile: it would print on every run's console)."""
    import mlflow.onnx

    if importlib.util.find_spec("onnxruntime") is not None:
        yield
        return
    check = mlflow.onnx._validate_onnx_session_options
    mlflow.onnx._validate_onnx_session_options = lambda options: None
    mismatches = logging.getLogger("mlflow.utils.requirements_utils")
    level = mismatches.level
    mismatches.setLevel(logging.ERROR)
    try:
        yield
    finally:
        mlflow.onnx._validate_onnx_session_options = check
        mismatches.setLevel(level)


def mlflow_name_checks() -> tuple[Callable[[str], None], Callable[[str], None]]:
    """MLflow's own checks of a tag's key and of a registered model's name (each raises
    MlflowException), which it runs only when it is handed them: at the run's start, at its end."""
    from mlflow.utils import validation

    return validation._validate_tag_name, validation._validate_model_name


def mlflow_dataset_entity(dataset):
    """An MLflow dataset as the entity a `DatasetInput` holds (MlflowClient.log_inputs takes only
    those; mlflow.log_input makes it privately)."""
    return dataset._to_mlflow_entity()


def mlflow_store_schemes() -> set[str]:
    """The URI schemes MLflow has a tracking store for (its own and its plugins'); empty if this
    MLflow keeps them elsewhere. MLflow lists them nowhere public."""
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    return set(getattr(_tracking_store_registry, "_registry", {}))
