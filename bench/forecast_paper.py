"""A sanity check of study.forecast's shape (not a fit) against the TF-Replicator paper's ResNet-50
scaling (Buchlovsky et al. 2019, Table 2), with the paper's stated hardware as input.

Run: python bench/forecast_paper.py

Inputs, all from the paper except the link: ResNet-50 (25.6 M parameters: 102 MB of fp32
gradients), 64 images per GPU, one GPU trains 90 ImageNet epochs (1,281,167 images) in 7,118
min, i.e. 270 images/s or 0.237 s per step, taken as compute (its split is not stated); 8 GPUs
per machine, NVLink-connected (taken as a 150 GB/s ring); 32 and 64 GPUs are 4 and 8 machines.
The paper does not state the network between machines: three links are shown.
"""

from __future__ import annotations

from workbench._src.studies.forecast import forecast
from workbench._src.studies.scaling import TF_REPLICATOR_RESNET50_MINUTES, reference_speedup

IMAGES = 90 * 1_281_167
STEP = 64 / (IMAGES / (TF_REPLICATOR_RESNET50_MINUTES[1] * 60))  # seconds per step on one GPU
BASELINE = {"replicas": 1, "per_replica_batch": 64, "input_s": 0.0, "compute_s": STEP,
            "communication_s": 0.0, "other_s": 0.0, "gradient_bytes": 25.6e6 * 4}  # fmt: skip


def main():
    paper = reference_speedup(TF_REPLICATOR_RESNET50_MINUTES)
    print(
        f"one GPU: {STEP * 1e3:.0f} ms per step of 64 images; gradients {BASELINE['gradient_bytes'] / 1e6:.0f} MB"
    )
    print("GPUs  paper efficiency   forecast efficiency at 10 / 25 / 100 Gbit/s between machines")
    tables = {
        g: forecast(BASELINE, [1, 4, 8], link_gbps=g, devices_per_worker=8, intra_gbps=1200.0)
        for g in (10, 25, 100)
    }
    for i, gpus in enumerate((8, 32, 64)):
        forecasts = " / ".join(f"{tables[g].iloc[i]['efficiency']:.0%}" for g in (10, 25, 100))
        print(f"{gpus:4d}  {paper[gpus] / gpus:16.0%}   {forecasts}")
    print("\n" + repr(tables[25]))


if __name__ == "__main__":
    main()
