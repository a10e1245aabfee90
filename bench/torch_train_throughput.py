#!/usr/bin/python3
"""PyTorch side of bench/train_vs_torch.sh: samples per second of the training step (forward,
backward, torch.optim.SGD step) of the same model, batch and thread count as
pipesgd_train_bench, on random inputs.

    pipesgd_train_bench CONFIG --print-job > job.json
    python3 bench/torch_train_throughput.py job.json --batch 64 --threads 1
    python3 bench/torch_train_throughput.py job.json --batch 64 --device cuda   (GPU 0)

Prints one JSON object, like pipesgd_train_bench.
"""
import argparse
import json
import statistics
import time

import torch


def build(model_cfg):
    """The pipesgd model of a job (its JSON with defaults filled) as torch.nn.Sequential."""
    c, h, w = model_cfg["input_channels"], model_cfg["input_height"], model_cfg["input_width"]
    layers, flat = [], False
    for layer in model_cfg["layers"]:
        (kind, spec), = layer.items()
        if kind == "linear":
            if not flat:  # pipesgd's linear flattens its input itself
                layers.append(torch.nn.Flatten())
                c, h, w, flat = c * h * w, 1, 1, True
            layers.append(torch.nn.Linear(c, spec["out_features"]))
            c = spec["out_features"]
        elif kind == "relu":
            layers.append(torch.nn.ReLU())
        elif kind == "conv2d":
            k, s, p = spec["kernel_size"], spec["stride"], spec["padding"]
            layers.append(torch.nn.Conv2d(c, spec["out_channels"], k, stride=s, padding=p))
            c, h, w = spec["out_channels"], (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
        elif kind == "max_pool2d":
            k = spec["kernel_size"]
            s = spec["stride"] or k
            layers.append(torch.nn.MaxPool2d(k, stride=s))
            h, w = (h - k) // s + 1, (w - k) // s + 1
        elif kind == "dropout":
            layers.append(torch.nn.Dropout(spec["p"]))
        elif kind == "flatten":
            layers.append(torch.nn.Flatten())
            c, h, w, flat = c * h * w, 1, 1, True
        else:
            raise SystemExit(f"unknown layer kind {kind}")
    return torch.nn.Sequential(*layers)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job_json")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    with open(args.job_json) as f:
        job = json.load(f)
    m = job["model"]
    device = torch.device(args.device)
    model = build(m).to(device)
    train = job["train"]
    opt = torch.optim.SGD(model.parameters(), lr=train["learning_rate"],
                          momentum=train["momentum"], weight_decay=train["weight_decay"])
    x = (torch.rand(args.batch, m["input_channels"], m["input_height"], m["input_width"]) * 3
         - 1).to(device)
    classes = m["layers"][-1]["linear"]["out_features"]
    y = torch.randint(0, classes, (args.batch,)).to(device)
    if device.type == "cuda":  # full FP32 GEMMs, as pipesgd's cuBLAS path
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    loss_fn = torch.nn.CrossEntropyLoss()

    def run(n):
        for _ in range(n):
            opt.zero_grad(set_to_none=False)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            # pipesgd's trainer reads every step's loss on the host; so does this loop.
            loss.item()
        if device.type == "cuda":
            torch.cuda.synchronize()

    model.train()
    run(args.warmup)
    rates = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        run(args.steps)
        rates.append(args.steps * args.batch / (time.perf_counter() - start))
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"impl": f"pytorch {torch.__version__}", "params": params,
                      "batch": args.batch, "device": str(device), "threads": torch.get_num_threads(),
                      "mkldnn": torch.backends.mkldnn.is_available(), "steps": args.steps,
                      "samples_per_s": [round(r, 1) for r in rates],
                      "median_samples_per_s": round(statistics.median(rates), 1)}))


if __name__ == "__main__":
    main()
