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
    GPUMARKET_DOCKER_PULL  always (default) | missing: a catalogue image on the node is not pulled again; a renter's
                           own image, or one with registry credentials, is pulled all the same (its registry decides)
    GPUMARKET_SIM_PROFILE, GPUMARKET_SIM_ROOT, GPUMARKET_SIM_LISTEN   sim: profile file, node folder, address
    GPUMARKET_LIBVIRT_URI, GPUMARKET_LIBVIRT_DIR, GPUMARKET_LIBVIRT_IMAGES   libvirt: connection and folders
Stdlib only, Python 3.8+. Nothing from a request ever reaches a shell: commands are argument lists.
This package re-exports every module's public names, each module imported when one of its names is first used.
"""
import importlib

# Each public name and the module it comes from, imported on first use (PEP 562): a command run on a node
# loads only the modules it needs.
_EXPORTS = {
    "AGENT_VERSION": "core",
    "AgentError": "core",
    "BENCH_LIMIT_S": "benchmark",
    "CLOCK_EVENT_BITS": "telemetry",
    "COMMANDS": "cli",
    "Config": "core",
    "DOCKER_LIST_ARGV": "runtimes.docker",
    "Deadline": "benchmark",
    "DockerRuntime": "runtimes.docker",
    "ENV_NAME_RE": "options",
    "IDENTITY_FIELDS": "smi",
    "KEY_TYPES": "validation",
    "LIBVIRT_SSH_USER": "runtimes.libvirt",
    "LOAD_PHASES": "telemetry",
    "LibvirtRuntime": "runtimes.libvirt",
    "MATMUL_DTYPES": "measurements",
    "MAX_REQUEST_BYTES": "core",
    "NVIDIA_SMI_QUERY": "smi",
    "P2P_BYTES": "topology",
    "PACKAGE_DIR": "bundle",
    "PLATFORM_VM_ID_RE": "validation",
    "QUERY_FIELDS": "smi",
    "RUNTIMES": "core",
    "RUNTIME_CLASSES": "runtimes",
    "Runtime": "runtimes.base",
    "SIM_CNN": "benchmark",
    "SimRuntime": "runtimes.sim",
    "TELEMETRY_FIELDS": "telemetry",
    "Telemetry": "telemetry",
    "VM_ID_RE": "validation",
    "VOLUME_NAME_RE": "options",
    "all_records": "records",
    "all_volumes": "volumes",
    "bench_plan": "measurements",
    "bench_slices": "mig",
    "build_zipapp": "bundle",
    "check_gpus_free": "vm",
    "clock_event_names": "telemetry",
    "cloud_init_meta_data": "runtimes.libvirt",
    "cloud_init_user_data": "runtimes.libvirt",
    "cmd_benchmark": "benchmark",
    "cmd_health": "cli",
    "cmd_inventory": "cli",
    "cmd_vm": "vm",
    "cmd_volume": "volumes",
    "cmd_volumes": "vm",
    "copy_agent": "bundle",
    "copy_gbs": "measurements",
    "describe": "vm",
    "describe_device": "measurements",
    "describe_topology": "topology",
    "docker_config_json": "runtimes.docker",
    "docker_run_argv": "runtimes.docker",
    "docker_state": "runtimes.docker",
    "docker_verb_argv": "runtimes.docker",
    "emit": "core",
    "fake_nvidia_smi_script": "runtimes.sim",
    "file_lock": "records",
    "find_sshd": "runtimes.sim",
    "handle": "cli",
    "host_facts": "smi",
    "host_link_gbs": "measurements",
    "import_torch": "measurements",
    "invalid": "core",
    "internal_registry": "reference",
    "inventory_hash": "smi",
    "kill_trees": "procs",
    "libvirt_domain_xml": "runtimes.libvirt",
    "libvirt_share": "runtimes.libvirt",
    "list_text": "mig",
    "load_profile": "smi",
    "load_record": "records",
    "load_volume": "volumes",
    "main": "cli",
    "matmul_errors": "measurements",
    "matmul_tflops": "measurements",
    "measure": "measurements",
    "measure_p2p": "topology",
    "median_seconds": "measurements",
    "nvlink_islands": "topology",
    "on_every_device": "measurements",
    "os_release_pretty_name": "runtimes.base",
    "p2p_figures": "benchmark",
    "package_files": "bundle",
    "parse_cuda_version": "smi",
    "parse_gpu_csv": "smi",
    "parse_mig_list": "mig",
    "parse_nvlink_status": "topology",
    "parse_reference": "reference",
    "parse_telemetry": "telemetry",
    "parse_topo_matrix": "topology",
    "pci_address": "runtimes.libvirt",
    "pick_host_port": "records",
    "pick_runtime": "vm",
    "pids_matching": "procs",
    "port_free": "procs",
    "proc_table": "procs",
    "product_rows": "challenge",
    "pull_reason": "runtimes.docker",
    "qemu_img_overlay_argv": "runtimes.libvirt",
    "read_gpus": "smi",
    "read_json": "core",
    "read_mig": "mig",
    "read_topology": "topology",
    "registry_key": "reference",
    "reject_unknown": "validation",
    "reveal_rows": "challenge",
    "row_digest": "challenge",
    "run": "core",
    "run_exchange": "challenge",
    "running_archive": "bundle",
    "save_record": "records",
    "seed_iso_argv": "runtimes.libvirt",
    "set_tf32": "measurements",
    "sim_benchmark": "benchmark",
    "sim_nvidia_smi": "runtimes.sim",
    "sim_nvlink_text": "topology",
    "sim_p2p_gbs": "topology",
    "sim_slices": "mig",
    "sim_sshd_config": "runtimes.sim",
    "sim_topo_text": "topology",
    "sim_work": "challenge",
    "small_cnn_images_s": "measurements",
    "smi_value": "smi",
    "split_smi_line": "smi",
    "start_watchdog": "benchmark",
    "used_by": "volumes",
    "validate_benchmark": "benchmark",
    "validate_challenge": "challenge",
    "validate_create": "validation",
    "validate_env": "options",
    "validate_gpu_indices": "validation",
    "validate_mig_uuids": "mig",
    "validate_mount": "options",
    "validate_options": "options",
    "validate_ports": "options",
    "validate_public_key": "validation",
    "validate_registry_auth": "options",
    "validate_vm_id": "validation",
    "validate_volumes": "options",
    "virsh_argv": "runtimes.libvirt",
    "vm_create": "vm",
    "vm_dir": "records",
    "vm_list": "vm",
    "vm_name": "runtimes.base",
    "vm_simple": "vm",
    "vm_start": "vm",
    "wait_port": "procs",
    "warm_up": "measurements",
    "write_file": "core",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError("module %r has no attribute %r" % (__name__, name))
    value = getattr(importlib.import_module("." + module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
