"""gpumarket node agent: uploaded to a GPU server over SFTP as one zipapp (bundle.py) and run over SSH.

    python3 gpumarket_agent-<hash>.pyz <command> [<subcommand>]  < request.json

Commands: inventory, health, benchmark, challenge and memproof (interactive: challenge.py, memproof.py),
vm create|start|stop|destroy|list|status|logs, volume create|delete|list. The request is one JSON
object on stdin (empty stdin = {}); the answer is exactly one JSON object on stdout:
    {"ok": true, "agent_version": "...", ...}
    {"ok": false, "agent_version": "...", "error": {"code": "...", "message": "...", "field": "..."}}
Exit status: 0 ok, 2 bad request (invalid_request), 1 any other error.

The node's configuration comes from its environment (sshd `SetEnv` on simulated nodes):
    GPUMARKET_RUNTIME      sim | docker | libvirt: the node's runtime; a request may not ask for another
    GPUMARKET_STATE_DIR    where VM records live (default ~/.gpumarket; in sim mode $GPUMARKET_SIM_ROOT)
    GPUMARKET_PUBLIC_HOST  address renters use to reach VMs (default: sim listen address, else null)
    GPUMARKET_PORT_RANGE   host ports for VM SSH and mapped ports with docker/libvirt (default 40000-40999)
    GPUMARKET_DOCKER_GPUS  toolkit (default: --gpus) | none | devices:/host/path{index} (--device, for tests)
    GPUMARKET_DOCKER_BIND  host address docker publishes VM ports on (default: all)
    GPUMARKET_DOCKER_PULL  always (default) | missing
    GPUMARKET_SIM_PROFILE, GPUMARKET_SIM_ROOT, GPUMARKET_SIM_LISTEN   sim: profile file, node folder, address
    GPUMARKET_LIBVIRT_URI, GPUMARKET_LIBVIRT_DIR, GPUMARKET_LIBVIRT_IMAGES   libvirt: connection and folders
Stdlib only, Python 3.8+. Nothing from a request ever reaches a shell: commands are argument lists.
This package re-exports every module's public names.
"""
from .benchmark import (
    BENCH_LIMIT_S,
    SIM_CNN,
    Deadline,
    cmd_benchmark,
    emit,
    p2p_figures,
    sim_benchmark,
    start_watchdog,
    validate_benchmark,
)
from .bundle import PACKAGE_DIR, build_zipapp, copy_agent, package_files, running_archive
from .challenge import product_rows, reveal_rows, row_digest, run_exchange, sim_work, validate_challenge
from .cli import COMMANDS, cmd_health, cmd_inventory, handle, main
from .core import AGENT_VERSION, MAX_REQUEST_BYTES, RUNTIMES, AgentError, Config, invalid, read_json, run, write_file
from .measurements import (
    MATMUL_DTYPES,
    bench_plan,
    copy_gbs,
    describe_device,
    host_link_gbs,
    import_torch,
    matmul_errors,
    matmul_tflops,
    measure,
    median_seconds,
    on_every_device,
    set_tf32,
    small_cnn_images_s,
    warm_up,
)
from .mig import bench_slices, list_text, parse_mig_list, read_mig, sim_slices, validate_mig_uuids
from .options import (
    ENV_NAME_RE,
    VOLUME_NAME_RE,
    validate_env,
    validate_mount,
    validate_options,
    validate_ports,
    validate_registry_auth,
    validate_volumes,
)
from .procs import kill_trees, pids_matching, port_free, proc_table, wait_port
from .records import all_records, file_lock, load_record, pick_host_port, save_record, vm_dir
from .reference import parse_reference, registry_key
from .runtimes import RUNTIME_CLASSES
from .runtimes.base import Runtime, os_release_pretty_name, vm_name
from .runtimes.docker import (
    DOCKER_LIST_ARGV,
    DockerRuntime,
    docker_config_json,
    docker_run_argv,
    docker_state,
    docker_verb_argv,
    pull_reason,
)
from .runtimes.libvirt import (
    LIBVIRT_SSH_USER,
    LibvirtRuntime,
    cloud_init_meta_data,
    cloud_init_user_data,
    libvirt_domain_xml,
    libvirt_share,
    pci_address,
    qemu_img_overlay_argv,
    seed_iso_argv,
    virsh_argv,
)
from .runtimes.sim import SimRuntime, fake_nvidia_smi_script, find_sshd, sim_nvidia_smi, sim_sshd_config
from .smi import (
    IDENTITY_FIELDS,
    NVIDIA_SMI_QUERY,
    QUERY_FIELDS,
    host_facts,
    inventory_hash,
    load_profile,
    parse_cuda_version,
    parse_gpu_csv,
    read_gpus,
    smi_value,
    split_smi_line,
)
from .telemetry import CLOCK_EVENT_BITS, LOAD_PHASES, TELEMETRY_FIELDS, Telemetry, clock_event_names, parse_telemetry
from .topology import (
    P2P_BYTES,
    describe_topology,
    measure_p2p,
    nvlink_islands,
    parse_nvlink_status,
    parse_topo_matrix,
    read_topology,
    sim_nvlink_text,
    sim_p2p_gbs,
    sim_topo_text,
)
from .validation import (
    KEY_TYPES,
    PLATFORM_VM_ID_RE,
    VM_ID_RE,
    reject_unknown,
    validate_create,
    validate_gpu_indices,
    validate_public_key,
    validate_vm_id,
)
from .vm import check_gpus_free, cmd_vm, cmd_volumes, describe, pick_runtime, vm_create, vm_list, vm_simple, vm_start
from .volumes import all_volumes, cmd_volume, load_volume, used_by

__all__ = [
    "bench_slices", "list_text", "parse_mig_list", "read_mig", "sim_slices", "validate_mig_uuids",
    "P2P_BYTES", "describe_topology", "p2p_figures", "measure_p2p", "nvlink_islands", "parse_nvlink_status",
    "parse_topo_matrix", "read_topology", "sim_nvlink_text", "sim_p2p_gbs", "sim_topo_text",
    "AGENT_VERSION", "AgentError", "BENCH_LIMIT_S", "CLOCK_EVENT_BITS", "COMMANDS", "Config", "DOCKER_LIST_ARGV",
    "Deadline", "DockerRuntime", "IDENTITY_FIELDS", "KEY_TYPES", "LIBVIRT_SSH_USER", "LOAD_PHASES",
    "LibvirtRuntime", "MATMUL_DTYPES", "MAX_REQUEST_BYTES", "NVIDIA_SMI_QUERY", "PACKAGE_DIR", "PLATFORM_VM_ID_RE",
    "QUERY_FIELDS", "RUNTIMES", "RUNTIME_CLASSES", "Runtime", "SIM_CNN", "SimRuntime", "TELEMETRY_FIELDS",
    "Telemetry", "VM_ID_RE",
    "all_records", "bench_plan", "build_zipapp", "check_gpus_free", "clock_event_names", "cloud_init_meta_data",
    "cloud_init_user_data", "cmd_benchmark", "cmd_health", "cmd_inventory", "cmd_vm", "copy_agent", "copy_gbs",
    "describe", "describe_device", "docker_run_argv", "docker_state", "docker_verb_argv", "emit",
    "fake_nvidia_smi_script", "file_lock", "find_sshd", "handle", "host_facts", "host_link_gbs", "import_torch",
    "invalid", "inventory_hash", "kill_trees", "libvirt_domain_xml", "libvirt_share", "load_profile", "load_record",
    "main", "matmul_errors", "matmul_tflops", "measure", "median_seconds", "on_every_device", "package_files",
    "parse_cuda_version", "parse_gpu_csv", "parse_telemetry", "pci_address", "pick_host_port", "pick_runtime",
    "product_rows", "reveal_rows", "row_digest", "run_exchange", "sim_work", "validate_challenge",
    "pids_matching", "port_free", "proc_table", "qemu_img_overlay_argv", "read_gpus", "read_json", "reject_unknown",
    "run", "running_archive", "save_record", "seed_iso_argv", "set_tf32", "sim_benchmark", "sim_nvidia_smi",
    "sim_sshd_config", "small_cnn_images_s", "smi_value", "split_smi_line", "start_watchdog", "validate_benchmark",
    "validate_create", "validate_gpu_indices", "validate_public_key", "validate_vm_id", "virsh_argv", "vm_create",
    "vm_dir", "vm_list", "vm_name", "vm_simple", "vm_start", "wait_port", "warm_up", "write_file",
    "ENV_NAME_RE", "VOLUME_NAME_RE", "all_volumes", "cmd_volume", "cmd_volumes", "load_volume",
    "os_release_pretty_name", "parse_reference", "registry_key", "used_by", "validate_env", "validate_mount",
    "validate_options", "docker_config_json", "pull_reason", "validate_ports", "validate_registry_auth",
    "validate_volumes",
]
