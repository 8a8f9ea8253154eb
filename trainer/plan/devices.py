"""The devices `mantra plan` knows: compute peak, memory, memory bandwidth and links.

    >>> get_device("h100").peak_tflops
    989.0

Peak dense BF16 TFLOP/s comes from trainer.report.meter.DEVICE_PEAK_TFLOPS (the
table the training loop's MFU uses, so plan and run agree on the denominator).
Link numbers are per GPU and per direction. `hbm_gib` is the capacity a
process sees (`torch.cuda.get_device_properties().total_memory`, which is the
datasheet's "80 GB" read as GiB, less a little the driver keeps). The host
CPU's numbers are read from this machine where possible and are otherwise
rough: plan's times on a CPU are for orientation, its memory is exact.

`--gpu auto` (plan's default) picks the device a manifest will run on:
`choose_device("auto", "slurm")` is the H100 (a cluster's GPUs, which this
machine cannot see), `choose_device("auto", "local")` this machine, its
NVIDIA GPU if nvidia-smi lists one, else its CPU; each answer comes with the
reason plan prints in its first line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from trainer.report.meter import DEVICE_PEAK_TFLOPS

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class Device:
    key: str  # what --gpu takes
    name: str
    peak_tflops: float  # dense, the training precision's tensor-core peak (bf16 on GPUs, fp32 on the CPU)
    hbm_gib: float  # memory one process can use
    hbm_gbps: float  # memory bandwidth, GB/s
    intra_gbps: float  # one direction, one GPU, inside a node (NVLink), GB/s
    inter_gbps: float  # one direction, one GPU, between nodes (InfiniBand), GB/s
    gpus_per_node: int
    precision: str  # what precision "auto" means on it: bf16 (autocast over fp32 master weights) | fp32
    fused_adamw: bool  # torch's fused AdamW kernel (no foreach temporaries)
    basis: str = ""  # how peak_tflops was arrived at, where it is an estimate (the host CPU)
    # host work of one tensor-parallel linear's pass (forward, input gradient, weight gradient) beyond its FLOPs, in
    # FLOP-equivalents of this device: DTensor's dispatch and redistribution. A GPU's host runs ahead of its kernels
    # (0); a CPU does it on the cores that compute, so it scales with the efficiency a calibration finds.
    tp_host_flops: float = 0.0
    tp_root_host_flops: float = 0.0  # the same for the vocab-parallel embedding, head and loss, per microbatch
    threads: int = 0  # the host CPU: OMP_NUM_THREADS where set (each rank's threads, as `mantra run` gives them)

    @property
    def is_gpu(self) -> bool:
        return self.key != "cpu"

    def rank_share(self, world: int) -> float:
        """The share of peak_tflops one of `world` ranks computes at: a GPU's whole; the host CPU's cores split
        among the ranks as `mantra run` splits them (OMP_NUM_THREADS if set, else cores // ranks, at least 1:
        launchers/local.py), so two ranks on two cores each run at half the host's peak."""
        if self.is_gpu:
            return 1.0
        cores = self.gpus_per_node  # the host CPU's (host_cpu)
        threads = self.threads or max(1, cores // world)
        return min(threads, cores / world) / cores


DEVICES: dict[str, Device] = {
    "h100": Device(
        "h100", "H100 SXM 80GB", DEVICE_PEAK_TFLOPS["H100"],
        hbm_gib=79.1,  # 80 GB HBM3 (NVIDIA H100 datasheet); total_memory 85.0e9 B on an H100 80GB HBM3
        hbm_gbps=3350,  # H100 datasheet, SXM: 3.35 TB/s
        intra_gbps=450,  # NVLink 4: 900 GB/s per GPU, both directions together (H100 datasheet)
        inter_gbps=50,  # one ConnectX-7 NDR 400 Gb/s per GPU (DGX H100 user guide)
        gpus_per_node=8, precision="bf16", fused_adamw=True,
    ),
    "h200": Device(
        "h200", "H200 SXM 141GB", DEVICE_PEAK_TFLOPS["H200"],
        hbm_gib=139.8,  # 141 GB HBM3e (NVIDIA H200 datasheet); torch reports ~139.8 GiB (143,771 MiB)
        hbm_gbps=4800,  # H200 datasheet: 4.8 TB/s
        intra_gbps=450,  # NVLink 4: 900 GB/s per GPU (H200 datasheet)
        inter_gbps=50,  # ConnectX-7 400 Gb/s per GPU (HGX H200 reference design)
        gpus_per_node=8, precision="bf16", fused_adamw=True,
    ),
    "a100": Device(
        "a100", "A100 SXM 80GB", DEVICE_PEAK_TFLOPS["A100"],
        hbm_gib=79.2,  # 80 GB HBM2e (NVIDIA A100 datasheet)
        hbm_gbps=2039,  # A100 80GB SXM datasheet: 2,039 GB/s
        intra_gbps=300,  # NVLink 3: 600 GB/s per GPU (A100 datasheet)
        inter_gbps=25,  # one HDR 200 Gb/s HCA per GPU (DGX A100 user guide)
        gpus_per_node=8, precision="bf16", fused_adamw=True,
    ),
    "b200": Device(
        "b200", "B200 180GB", DEVICE_PEAK_TFLOPS["B200"],
        hbm_gib=178.0,  # 180 GB HBM3e per GPU (HGX B200 datasheet: 1,440 GB for 8)
        hbm_gbps=8000,  # HGX B200 datasheet: 8 TB/s per GPU (64 TB/s for 8)
        intra_gbps=900,  # NVLink 5: 1.8 TB/s per GPU (HGX B200 datasheet)
        inter_gbps=50,  # ConnectX-7 400 Gb/s per GPU (DGX B200 user guide)
        gpus_per_node=8, precision="bf16", fused_adamw=True,
    ),
}


def _cpuinfo() -> tuple[float, int, str]:
    """(GHz, fp32 FLOP per cycle per core, where they came from) from /proc/cpuinfo: two FMA units of 16
    lanes with AVX-512, 8 with AVX2 (x2 for multiply-add); 2.5 GHz and AVX2 when it cannot be read."""
    ghz, flops, source = 2.5, 32, "assumed: /proc/cpuinfo unreadable"
    try:
        text = open("/proc/cpuinfo", encoding="utf-8").read()
    except OSError:
        return ghz, flops, source
    for line in text.splitlines():
        if line.startswith("cpu MHz"):
            ghz, source = float(line.split(":")[1]) / 1000, "/proc/cpuinfo"
        elif line.startswith("flags"):
            flops = 64 if " avx512f" in line else 32
            break
    return ghz, flops, source


# gloo between ranks of one host: all_reduce busbw 0.75 GB/s at 1 MiB on 2 ranks (bench/results/comm-gloo-2ranks-2026-11-30.jsonl)
CPU_LINK_GBPS = 0.75
# Measured by bench/tp_overhead.py (bench/results/tp_overhead-2026-12-03.jsonl; one tiny-cpu block, and its embedding,
# head and loss, on 2 ranks with one thread each against the same on one rank): what a tensor-parallel rank takes
# beyond its share of the FLOPs and its all-reduces, in FLOP-equivalents of the plain block's rate. Per block linear
# pass (forward, input gradient, weight gradient), and per microbatch for the vocab-parallel embedding, head and loss.
CPU_TP_HOST_FLOPS = 100e6
CPU_TP_ROOT_HOST_FLOPS = 900e6


def _omp_threads() -> int:
    """OMP_NUM_THREADS as `mantra run` passes it to each rank (0: not set, or not a whole number >= 1)."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) >= 1 else 0


def host_cpu() -> Device:
    """This machine's CPU, read without torch: cores, clock, vector width and RAM; links assumed.

    peak: cores x GHz x fp32 FLOP/cycle (two FMA units): an upper bound a CPU matmul rarely reaches.
    links: ranks on one host talk through gloo over loopback (CPU_LINK_GBPS, measured by bench/comm.py).
    """
    cores = os.cpu_count() or 1
    ghz, per_cycle, source = _cpuinfo()
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError, AttributeError):
        ram = 16.0
    peak = cores * ghz * per_cycle / 1e3
    basis = (f"assumed peak {peak * 1e3:,.0f} GFLOP/s fp32 = {cores} cores x {ghz:.2f} GHz x {per_cycle} FLOP/cycle "
             f"({'AVX-512' if per_cycle == 64 else 'AVX2'}, {source})")
    return Device("cpu", f"host CPU ({cores} cores)", peak, hbm_gib=round(ram, 1), hbm_gbps=20, intra_gbps=CPU_LINK_GBPS,
                  inter_gbps=1, gpus_per_node=cores, precision="fp32", fused_adamw=False, basis=basis,
                  tp_host_flops=CPU_TP_HOST_FLOPS, tp_root_host_flops=CPU_TP_ROOT_HOST_FLOPS, threads=_omp_threads())


def device_names() -> list[str]:
    return [*DEVICES, "cpu"]


def local_gpu() -> tuple[str | None, str]:
    """(the name of this machine's first NVIDIA GPU as nvidia-smi gives it, or None; how that was found): none
    when CUDA_VISIBLE_DEVICES hides them all (as the run itself would see), without nvidia-smi, or when it lists
    none. Torch-free: plan never imports torch."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return None, "CUDA_VISIBLE_DEVICES hides every GPU"
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "no nvidia-smi on PATH"
    try:
        out = subprocess.run([exe, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None, "nvidia-smi did not answer"
    names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return (names[0], "nvidia-smi") if out.returncode == 0 and names else (None, "nvidia-smi lists none")


def _this_machine() -> tuple[Device, str]:
    gpu, how = local_gpu()
    if gpu is None:
        cpu = host_cpu()
        return cpu, f"this machine, no GPU ({how}); {cpu.basis}"
    known = [key for key in DEVICES if key in gpu.lower().replace(" ", "")]
    if known:
        return DEVICES[known[0]], f"this machine's GPU ({gpu}, from {how})"
    return DEVICES["h100"], f"assumed: this machine's GPU ({gpu}) is not in plan's table; choose with --gpu"


def choose_device(key: str, launcher: str = "local") -> tuple[Device, str]:
    """The device to plan for and why, for --gpu KEY (auto | h100 | h200 | a100 | b200 | cpu).

    auto: a Slurm manifest runs on a cluster's GPUs, which this machine cannot see: the H100, said to be the
    default; a local manifest runs here: this machine's GPU (nvidia-smi) or, without one, its CPU."""
    key = key.lower()
    if key == "auto":
        if launcher == "slurm":
            return DEVICES["h100"], "--gpu h100, the default for a Slurm manifest; choose with --gpu"
        return _this_machine()
    device = get_device(key)
    return device, (f"--gpu cpu: this machine; {device.basis}" if key == "cpu" else f"--gpu {key}")


def get_device(key: str) -> Device:
    """The device for --gpu KEY (h100 | h200 | a100 | b200 | cpu, or auto: this machine's GPU, else its CPU);
    KeyError naming the choices otherwise."""
    key = key.lower()
    if key == "cpu":
        return host_cpu()
    if key == "auto":
        return _this_machine()[0]
    if key not in DEVICES:
        raise KeyError(f"unknown device '{key}'; use one of auto, {', '.join(device_names())}")
    return DEVICES[key]


# Usable memory is the capacity less what every CUDA process holds outside tensors: the CUDA context and
# kernels (~0.5-1 GiB), NCCL's buffers (~0.5-1 GiB per communicator set) and the caching allocator's
# fragmentation. `plan` counts a GPU layout as fitting when its predicted peak of live tensors stays below
# capacity minus this reserve. The CPU has no such overhead worth naming.
GPU_RESERVE_GIB = 2.0


def usable_bytes(device: Device, capacity_gib: float | None = None) -> float:
    """Bytes of tensors a rank can hold: the capacity (or --gpu-mem) less the reserve on a GPU."""
    cap = device.hbm_gib if capacity_gib is None else capacity_gib
    return (cap - (GPU_RESERVE_GIB if device.is_gpu else 0.0)) * GIB
