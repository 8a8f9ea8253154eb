"""The devices `mantra plan` knows: compute peak, memory, memory bandwidth and links.

    >>> get_device("h100").peak_tflops
    989.0

Peak dense BF16 TFLOP/s comes from trainer.metrics.DEVICE_PEAK_TFLOPS (the
table the training loop's MFU uses, so plan and run agree on the denominator).
Link numbers are per GPU and per direction. `hbm_gib` is the capacity a
process sees (`torch.cuda.get_device_properties().total_memory`, which is the
datasheet's "80 GB" read as GiB, less a little the driver keeps). The host
CPU's numbers are read from this machine where possible and are otherwise
rough: plan's times on a CPU are for orientation, its memory is exact.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from trainer.metrics import DEVICE_PEAK_TFLOPS

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

    @property
    def is_gpu(self) -> bool:
        return self.key != "cpu"


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


def _cpuinfo() -> tuple[float, int]:
    """(GHz, fp32 FLOP per cycle per core) from /proc/cpuinfo: two FMA units of 16 lanes with AVX-512,
    8 with AVX2 (x2 for multiply-add); 2.5 GHz and AVX2 when it cannot be read."""
    ghz, flops = 2.5, 32
    try:
        text = open("/proc/cpuinfo", encoding="utf-8").read()
    except OSError:
        return ghz, flops
    for line in text.splitlines():
        if line.startswith("cpu MHz"):
            ghz = float(line.split(":")[1]) / 1000
        elif line.startswith("flags"):
            flops = 64 if " avx512f" in line else 32
            break
    return ghz, flops


def host_cpu() -> Device:
    """This machine's CPU, read without torch: cores, clock, vector width and RAM; links assumed.

    peak: cores x GHz x fp32 FLOP/cycle (two FMA units): an upper bound a CPU matmul rarely reaches.
    links: ranks on one host talk through gloo over loopback, ~2 GB/s in practice on these machines.
    """
    cores = os.cpu_count() or 1
    ghz, per_cycle = _cpuinfo()
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError, AttributeError):
        ram = 16.0
    return Device("cpu", f"host CPU ({cores} cores)", cores * ghz * per_cycle / 1e3, hbm_gib=round(ram, 1),
                  hbm_gbps=20, intra_gbps=2, inter_gbps=1, gpus_per_node=cores, precision="fp32", fused_adamw=False)


def device_names() -> list[str]:
    return [*DEVICES, "cpu"]


def get_device(key: str) -> Device:
    """The device for --gpu KEY (h100 | h200 | a100 | b200 | cpu); KeyError naming the choices otherwise."""
    key = key.lower()
    if key == "cpu":
        return host_cpu()
    if key not in DEVICES:
        raise KeyError(f"unknown device '{key}'; use one of {', '.join(device_names())}")
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
