"""The GPUs a plan can assume: memory, dense peak throughput and memory bandwidth, from the vendor's
datasheets. Peaks are dense (NVIDIA's datasheets print the 2:4-sparse figure first; dense is half of
it); memory is the datasheet's GB (10^9 bytes). A node is 8 GPUs (HGX / DGX boards)."""

from __future__ import annotations

from dataclasses import dataclass

GPUS_PER_NODE = 8
USABLE_MEMORY = 0.9  # of a GPU's memory a plan may fill: the rest is the CUDA context, NCCL and the allocator's slack


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: float
    bf16_flops: float  # dense peak, FLOP/s
    fp8_flops: float | None  # dense peak, FLOP/s (None: no FP8 tensor cores)
    hbm_bytes_per_s: float
    source: str
    nvlink_bytes_per_s: float = 450e9  # one direction, per GPU, within a node (NVLink through NVSwitch)
    network_bytes_per_s: float = 50e9  # one direction, per GPU, across nodes (its InfiniBand / RoCE NIC)

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s at `precision` ("bf16" or "fp8")."""
        if precision == "bf16":
            return self.bf16_flops
        if precision == "fp8":
            if self.fp8_flops is None:
                raise ValueError(f"--precision fp8: the {self.name} has no FP8 tensor cores; use --precision bf16")
            return self.fp8_flops
        raise ValueError(f"--precision must be 'bf16' or 'fp8', got {precision!r}")

    @property
    def usable_bytes(self) -> float:
        return USABLE_MEMORY * self.memory_bytes


T, GB = 1e12, 1e9
# Interconnects, one direction per GPU: the datasheets' NVLink figures are both directions (H100 / H200 900 GB/s,
# B200 1.8 TB/s, A100 600 GB/s, H800 400 GB/s); across nodes one NIC per GPU: DGX H100 / H200 / B200 8 x 400 Gb/s
# ConnectX-7 (50 GB/s each), DGX A100 8 x 200 Gb/s HDR (25 GB/s), DeepSeek-V3's H800 nodes 8 x 400 Gb/s
# InfiniBand (its report: "IB ... 50 GB/s").
GPUS: dict[str, Gpu] = {
    gpu.name: gpu
    for gpu in (
        # NVIDIA H100 Tensor Core GPU datasheet, SXM5: 80 GB HBM3, 3.35 TB/s; BF16 1,979 / FP8 3,958 TFLOPS sparse
        Gpu("h100", 80 * GB, 989.5 * T, 1979 * T, 3.35e12, "NVIDIA H100 datasheet (SXM5)", 450 * GB, 50 * GB),
        # NVIDIA H200 Tensor Core GPU datasheet, SXM: 141 GB HBM3e, 4.8 TB/s; BF16 1,979 / FP8 3,958 TFLOPS sparse
        Gpu("h200", 141 * GB, 989.5 * T, 1979 * T, 4.8e12, "NVIDIA H200 datasheet (SXM)", 450 * GB, 50 * GB),
        # NVIDIA DGX B200 / HGX B200 datasheet: 1,440 GB and 64 TB/s per 8 GPUs; FP8 72 / BF16 36 PFLOPS sparse per 8
        Gpu(
            "b200",
            180 * GB,
            2250 * T,
            4500 * T,
            8e12,
            "NVIDIA HGX B200 datasheet (per GPU: 1/8 of the board)",
            900 * GB,
        ),
        # H800 SXM5: the H100 SXM5's compute and memory with NVLink cut to 400 GB/s (NVIDIA H800 product brief;
        # the DeepSeek-V3 report's cluster)
        Gpu("h800", 80 * GB, 989.5 * T, 1979 * T, 3.35e12, "NVIDIA H800 product brief (SXM5)", 200 * GB, 50 * GB),
        # NVIDIA A100 Tensor Core GPU datasheet, 80 GB SXM: HBM2e 2,039 GB/s; BF16 312 TFLOPS dense; no FP8
        Gpu("a100", 80 * GB, 312 * T, None, 2.039e12, "NVIDIA A100 datasheet (80 GB SXM)", 300 * GB, 25 * GB),
        # the same datasheet, 40 GB SXM (nanoGPT's GPT-2 reproduction ran on 8 of these): 1,555 GB/s
        Gpu("a100-40gb", 40 * GB, 312 * T, None, 1.555e12, "NVIDIA A100 datasheet (40 GB SXM)", 300 * GB, 25 * GB),
    )
}


def get_gpu(name: str) -> Gpu:
    if name not in GPUS:
        raise ValueError(f"--gpu must be one of {', '.join(GPUS)}, got {name!r}")
    return GPUS[name]
