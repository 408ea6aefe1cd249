"""Which HLO operation each GPU kernel of a profiled step ran for, and the FLOP rate of every matmul.

Reads the optimized, scheduled HLO text of the step (`compiled.as_text()`) and attributes kernel events
of a trace to its instructions: XLA's own kernels carry their instruction's name (other characters
than letters, digits and `_` as underscores); cuBLAS kernels are matched to the cuBLAS calls in
schedule order; cuDNN's and anything else unmatched keep their kernel names. Only the ENTRY
computation is read: with the layer loop rolled into a `while` (`model.scan_unroll=1`), the layers'
kernels keep their kernel names and get no FLOP rate; profile unrolled for the per-matmul table.
"""

from __future__ import annotations

import collections
import re
import sys

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\(?[a-z0-9]+\[[^=]*?) (\w[\w\-]*)\((.*)$")
_TUPLE_INDEX = re.compile(r"/\*index=\d+\*/")  # printed inside long tuple shapes
_SHAPE = re.compile(r"[a-z0-9]+\[([0-9,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _dims(shape: str) -> list[int]:
    m = _SHAPE.search(shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


class HloOps:
    """The instructions of one HLO module: shapes, op names, and matmul FLOPs."""

    def __init__(self, hlo_text: str):
        self.shape, self.op_name, self.flops = {}, {}, {}
        self.library_calls = []  # (name, custom-call target) in schedule order, ENTRY only
        computations, current, entry_lines = {}, None, []
        for line in hlo_text.splitlines():
            if line and not line[0].isspace() and line.rstrip().endswith("{"):
                current = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
                computations[current] = []
                if line.startswith("ENTRY"):
                    entry_lines = computations[current]
                continue
            m = _INSTRUCTION.match(_TUPLE_INDEX.sub("", line))
            if not m or current is None:
                continue
            name, shape, opcode, rest = m.groups()
            computations[current].append((name, opcode, rest))
            self.shape[name] = shape
            op = _OP_NAME.search(rest)
            self.op_name[name] = op.group(1) if op else opcode
        for name, opcode, rest in entry_lines:
            target = re.search(r'custom_call_target="([^"]*)"', rest)
            if opcode == "custom-call" and target:
                self.library_calls.append((name, target.group(1)))
                if "gemm" in target.group(1) or "matmul" in target.group(1):
                    lhs = rest.split(",")[0].strip().lstrip("%").rstrip(")")
                    contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', rest)
                    self._set_flops(name, lhs, [int(d.strip('"')) for d in contracting.group(1).split(",") if d])
            called = re.search(r"calls=%([\w.\-]+)", rest)
            if opcode == "fusion" and called and name.startswith("gemm_fusion"):
                for inner, inner_op, inner_rest in computations.get(called.group(1), []):
                    if inner_op == "dot":
                        lhs = inner_rest.split(",")[0].strip().lstrip("%")
                        dims = re.search(r"lhs_contracting_dims=\{([^}]*)\}", inner_rest)
                        self._set_flops(name, lhs, [int(d) for d in dims.group(1).split(",") if d], out_of=inner)

    def _set_flops(self, name: str, lhs: str, contracting: list[int], out_of: str | None = None) -> None:
        lhs_dims = _dims(self.shape.get(lhs, ""))
        out_dims = _dims(self.shape[out_of or name])
        if lhs_dims and all(d < len(lhs_dims) for d in contracting):
            k = 1
            for d in contracting:
                k *= lhs_dims[d]
            n = 1
            for d in out_dims:
                n *= d
            self.flops[name] = 2 * n * k

    def attribute(self, kernels: list[dict], steps: int) -> dict[str, list]:
        """{instruction: [device ms per step, kernel launches per step, kernel name]} for the events.

        XLA launches one kernel for all instructions of identical fusions (`deduplicated_name`): their
        time and launches land on the instruction whose name the kernel bears."""
        by_name = {re.sub(r"[^\w$]", "_", n): n for n in self.shape}
        out = collections.defaultdict(lambda: [0.0, 0, ""])
        unmatched = collections.defaultdict(list)  # library kernels, by the library that launched them
        for e in sorted(kernels, key=lambda e: e["ts"]):
            hlo_op = (e.get("args") or {}).get("hlo_op")
            name = hlo_op if hlo_op in self.shape else by_name.get(e["name"])
            if name is not None:
                _add(out[name], e, steps)
            else:
                # Not XLA's own: a matmul kernel here is cuBLAS's.
                unmatched["cublas" if kernel_class(e["name"]) == "matmul" else "other"].append(e)
        # cuBLAS launches one kernel per call: match them in launch order to the calls in schedule order.
        calls = [n for n, target in self.library_calls if "cublas" in target]
        events = unmatched.pop("cublas", [])
        if calls and len(events) == len(calls) * steps:
            for i, e in enumerate(events):
                _add(out[calls[i % len(calls)]], e, steps)
        elif events:
            print(f"hlo_ops: {len(events)} cuBLAS kernels for {len(calls)} calls x {steps} steps; "
                  "listed by kernel name instead", file=sys.stderr)
            unmatched["other"] += events
        for e in unmatched["other"]:
            _add(out[e["name"][:60]], e, steps)
        return out

    def scoped_ms(self, kernels: list[dict], steps: int, scope: str) -> tuple[float, float]:
        """(device ms per step of the kernels whose instruction's op name lies under `jax.named_scope(scope)`,
        of all kernels): a fusion counts where its root instruction was traced."""
        attributed = self.attribute(kernels, steps)
        inside = sum(ms for name, (ms, _, _) in attributed.items() if f"/{scope}/" in "/" + self.op_name.get(name, ""))
        return inside, sum(ms for ms, _, _ in attributed.values())

    def table(self, kernels: list[dict], steps: int, top: int) -> list[str]:
        """The operations grouped by (op name, shape), largest first, with each matmul group's TFLOP/s."""
        groups = collections.defaultdict(lambda: [0.0, 0, 0, set()])
        for name, (ms, launches, kernel) in self.attribute(kernels, steps).items():
            op = re.sub(r"jit\([^)]*\)/|eval_jaxpr/|checkpoint/|rematted_computation/", "",
                        self.op_name.get(name, name))
            g = groups[(op, self.shape.get(name, "").split("{")[0][:48])]
            g[0] += ms
            g[1] += launches
            g[2] += self.flops.get(name, 0) * launches
            g[3].add(kernel[:40])
        lines = [f"{'ms/step':>8} {'calls':>5} {'TFLOP/s':>8}  op (output shape) kernel"]
        for (op, shape), (ms, count, flops, names) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
            rate = f"{flops / (ms / 1e3) / 1e12:8.0f}" if flops and ms else " " * 8
            lines.append(f"{ms:8.2f} {count:5.0f} {rate}  {op[:70]} ({shape}) {','.join(sorted(names))[:60]}")
        return lines


def _add(slot: list, event: dict, steps: int) -> None:
    slot[0] += event["dur"] / 1e3 / steps
    slot[1] += 1 / steps
    slot[2] = slot[2] or event["name"]


def kernel_class(name: str) -> str:
    """A GPU kernel's rough class by its name: matmul, attention, pallas, copy, collective or other.
    Every Mosaic GPU kernel launches as `entry_mosaic_gpu_kernel`, so ours (attention, grouped
    matmuls) share the class "pallas"; the by-HLO-operation table tells them apart."""
    low = name.lower()
    if "mosaic_gpu" in low:
        return "pallas"
    if any(k in low for k in ("gemm", "cublas", "matmul", "sm90_xmma", "nvjet", "triton_gemm", "cutlass")):
        return "matmul"
    if any(k in low for k in ("fmha", "flash", "cudnn", "attention", "sdpa")):
        return "attention"
    if "memcpy" in low or "memset" in low:
        return "copy"
    if "nccl" in low:
        return "collective"
    return "other"
