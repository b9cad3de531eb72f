"""`kvcachedctl plan`: KV-cache memory of a GGUF model, from its header.

llama.cpp keeps, per layer, one K tensor of n_embd_k_gqa elements per cell
and one V tensor of n_embd_v_gqa elements per cell, where

    n_embd_k_gqa = key_length   * head_count_kv
    n_embd_v_gqa = value_length * head_count_kv
    key_length, value_length default to embedding_length / head_count

(GGUF keys `<arch>.block_count`, `<arch>.embedding_length`,
`<arch>.attention.head_count`, `<arch>.attention.head_count_kv` -- a number
or one per layer -- and `<arch>.attention.key_length` / `value_length`).
A cell is one token of one sequence, so a context of `ctx` tokens with
`parallel` sequences needs ctx * parallel cells (Ollama sizes llama.cpp's
context as num_ctx x parallel).

Cache types (llama-server --cache-type-k/-v, Ollama OLLAMA_KV_CACHE_TYPE):
f16 = 2 bytes per element; q8_0 = 34 bytes per block of 32; q4_0 = 18 bytes
per block of 32. A row of a quantized cache is whole blocks.

Pages: the daemon's elastic KV buffer maps a prefix of *each* tensor (all
layers' K and V live in one buffer, each tensor at a page-aligned offset; see
docs/llama-cpp.md), so the pages for n cells are the sum over the
2 x n_layer tensors of ceil(n * row_bytes / page_size).

Models are found through Ollama's store: $OLLAMA_MODELS, else
~/.ollama/models, else /usr/share/ollama/.ollama/models (the Linux service's
home). A name `[host/][namespace/]model[:tag]` (defaults registry.ollama.ai,
library, latest) names manifests/<host>/<namespace>/<model>/<tag>, a JSON
manifest whose layer of mediaType application/vnd.ollama.image.model has the
digest of the GGUF blob, blobs/sha256-<hex>.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from dataclasses import asdict, dataclass, field

from ..config import format_size

MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"

# cache type -> (bytes per block, elements per block)
CACHE_TYPES: dict[str, tuple[int, int]] = {"f16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32)}


class PlanError(Exception):
    """The model cannot be found or read, or has no KV cache we understand."""


# ---------------------------------------------------------------------------
# the Ollama model store
def model_dirs(env: dict | None = None) -> list[pathlib.Path]:
    env = os.environ if env is None else env
    if env.get("OLLAMA_MODELS"):
        return [pathlib.Path(env["OLLAMA_MODELS"]).expanduser()]
    home = pathlib.Path(env.get("HOME") or pathlib.Path.home())
    return [home / ".ollama" / "models", pathlib.Path("/usr/share/ollama/.ollama/models")]


def parse_model_name(name: str) -> tuple[str, str, str, str]:
    """'llama3' -> (registry.ollama.ai, library, llama3, latest);
    'me/m:q4' -> (registry.ollama.ai, me, m, q4); 'h.io/ns/m:t' -> (h.io, ns, m, t)."""
    rest, tag = name, DEFAULT_TAG
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > slash:
        rest, tag = rest[:colon], rest[colon + 1 :]
    parts = [p for p in rest.split("/") if p]
    if not parts or not tag or len(parts) > 3:
        raise PlanError(f"not an Ollama model name: {name!r} (expected [host/][namespace/]model[:tag])")
    if len(parts) == 1:
        return DEFAULT_HOST, DEFAULT_NAMESPACE, parts[0], tag
    if len(parts) == 2:
        return DEFAULT_HOST, parts[0], parts[1], tag
    return parts[0], parts[1], parts[2], tag


def _child_ci(parent: pathlib.Path, name: str) -> pathlib.Path | None:
    """parent/name, or a case-insensitive match (Ollama names are case-insensitive)."""
    p = parent / name
    if p.exists():
        return p
    try:
        for c in parent.iterdir():
            if c.name.lower() == name.lower():
                return c
    except OSError:
        pass
    return None


def resolve_ollama_model(name: str, env: dict | None = None) -> pathlib.Path:
    """The GGUF blob of an Ollama model name."""
    host, ns, model, tag = parse_model_name(name)
    tried = []
    for root in model_dirs(env):
        node: pathlib.Path | None = root / "manifests"
        for part in (host, ns, model, tag):
            node = _child_ci(node, part) if node is not None else None
        tried.append(str(root / "manifests" / host / ns / model / tag))
        if node is None or not node.is_file():
            continue
        try:
            manifest = json.loads(node.read_text())
        except (OSError, ValueError) as exc:
            raise PlanError(f"cannot read the manifest {node}: {exc}") from None
        layers = [l for l in manifest.get("layers", []) if l.get("mediaType") == MODEL_MEDIA_TYPE]
        if not layers:
            raise PlanError(f"manifest {node} has no layer of mediaType {MODEL_MEDIA_TYPE}")
        digest = str(layers[0].get("digest", ""))
        algo, sep, hexd = digest.partition(":")
        if not sep or not hexd:
            raise PlanError(f"manifest {node}: bad model digest {digest!r}")
        for blob in (root / "blobs" / f"{algo}-{hexd}", root / "blobs" / f"{algo}:{hexd}"):
            if blob.is_file():
                return blob
        raise PlanError(f"{name}: manifest {node} names blob {digest}, but {root / 'blobs' / f'{algo}-{hexd}'} is missing")
    where = "\n  ".join(tried)
    raise PlanError(f"no Ollama model {name!r}: no manifest at\n  {where}\n(set OLLAMA_MODELS, or pass a GGUF file path)")


# ---------------------------------------------------------------------------
# the GGUF header
@dataclass
class ModelShape:
    path: str
    arch: str
    n_layer: int
    n_embd: int
    n_head: list[int]
    n_head_kv: list[int]
    key_length: int
    value_length: int
    context_length: int = 0
    name: str = ""

    def k_elems(self, layer: int) -> int:
        return self.key_length * self.n_head_kv[layer]

    def v_elems(self, layer: int) -> int:
        return self.value_length * self.n_head_kv[layer]

    @property
    def elements_per_token(self) -> int:
        return sum(self.k_elems(i) + self.v_elems(i) for i in range(self.n_layer))

    def row_bytes(self, cache: str) -> list[int]:
        """Bytes per cell of each K and V tensor (2 per layer)."""
        return [row_bytes(n, cache) for i in range(self.n_layer) for n in (self.k_elems(i), self.v_elems(i)) if n]


def row_bytes(elements: int, cache: str) -> int:
    block_bytes, block_elems = CACHE_TYPES[cache]
    return math.ceil(elements / block_elems) * block_bytes


def _field(reader, key: str, required: bool = True):
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise PlanError(f"GGUF header has no {key}")
        return None
    return f.contents()


def _per_layer(value, n_layer: int, key: str) -> list[int]:
    if isinstance(value, list):
        if len(value) != n_layer:
            raise PlanError(f"{key} has {len(value)} entries for {n_layer} layers")
        return [int(v) for v in value]
    return [int(value)] * n_layer


def read_shape(path: str | os.PathLike) -> ModelShape:
    try:
        from gguf import GGUFReader
    except ImportError:
        raise PlanError("kvcachedctl plan needs the gguf package: pip install gguf") from None
    try:
        reader = GGUFReader(str(path), "r")
    except (OSError, ValueError) as exc:
        raise PlanError(f"{path}: not a readable GGUF file: {exc}") from None
    arch = _field(reader, "general.architecture")
    n_layer = int(_field(reader, f"{arch}.block_count"))
    n_embd = int(_field(reader, f"{arch}.embedding_length"))
    n_head = _per_layer(_field(reader, f"{arch}.attention.head_count"), n_layer, f"{arch}.attention.head_count")
    kv = _field(reader, f"{arch}.attention.head_count_kv", required=False)
    n_head_kv = _per_layer(kv, n_layer, f"{arch}.attention.head_count_kv") if kv is not None else list(n_head)
    if not n_head[0]:
        raise PlanError(f"{arch}.attention.head_count is 0: this model has no attention KV cache")
    k_len = _field(reader, f"{arch}.attention.key_length", required=False)
    v_len = _field(reader, f"{arch}.attention.value_length", required=False)
    head_dim = n_embd // n_head[0]
    ctx = _field(reader, f"{arch}.context_length", required=False)
    name = _field(reader, "general.name", required=False)
    return ModelShape(
        path=str(path),
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        key_length=int(k_len) if k_len is not None else head_dim,
        value_length=int(v_len) if v_len is not None else head_dim,
        context_length=int(ctx) if ctx is not None else 0,
        name=name or "",
    )


# ---------------------------------------------------------------------------
# the plan
@dataclass
class CachePlan:
    cache: str
    bytes_per_token: int
    pages_per_1k_tokens: int
    tokens_per_page: int  # cells one page of the widest tensor holds
    cells: int
    bytes: int  # exact bytes for `cells`
    pages: int  # pages to map `cells` (the tensors packed: their bytes rounded up to one page)
    paged_bytes: int


@dataclass
class Plan:
    model: str
    path: str
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int  # max over layers
    key_length: int
    value_length: int
    context_length: int
    elements_per_token: int
    ctx: int
    parallel: int
    page_size: int
    caches: list[CachePlan] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def pages_for(rows: list[int], cells: int, page_size: int, tensor_cells: int = 0) -> int:
    """Pages that back cells [0, cells) of every K/V tensor, the tensors
    ([row, tensor_cells] each, default `cells`) packed back to back as the
    llama.cpp hook lays them out: a page shared by two tensors counts once,
    so a full cache is its bytes rounded up to one page."""
    tensor_cells = tensor_cells or cells
    pages = off = end = 0
    for r in rows:
        lo, hi = max(off // page_size, end), math.ceil((off + cells * r) / page_size)
        if cells and hi > lo:
            pages, end = pages + hi - lo, hi
        off += r * tensor_cells
    return pages


def make_plan(shape: ModelShape, ctx: int, parallel: int, page_size: int, model: str = "") -> Plan:
    if ctx <= 0 or parallel <= 0 or page_size <= 0:
        raise PlanError("ctx, parallel and page size must be positive")
    cells = ctx * parallel
    plan = Plan(
        model=model or shape.name or pathlib.Path(shape.path).name,
        path=shape.path,
        arch=shape.arch,
        n_layer=shape.n_layer,
        n_embd=shape.n_embd,
        n_head=shape.n_head[0],
        n_head_kv=max(shape.n_head_kv),
        key_length=shape.key_length,
        value_length=shape.value_length,
        context_length=shape.context_length,
        elements_per_token=shape.elements_per_token,
        ctx=ctx,
        parallel=parallel,
        page_size=page_size,
    )
    for cache in CACHE_TYPES:
        rows = shape.row_bytes(cache)
        bpt = sum(rows)
        pages = pages_for(rows, cells, page_size)
        plan.caches.append(
            CachePlan(
                cache=cache,
                bytes_per_token=bpt,
                pages_per_1k_tokens=pages_for(rows, min(1000, cells), page_size, cells),
                tokens_per_page=page_size // max(rows) if rows else 0,
                cells=cells,
                bytes=bpt * cells,
                pages=pages,
                paged_bytes=pages * page_size,
            )
        )
    return plan


def plan_model(target: str, ctx: int, parallel: int, page_size: int, env: dict | None = None) -> Plan:
    """`target`: a GGUF file path, or an Ollama model name."""
    p = pathlib.Path(target).expanduser()
    if p.is_file():
        return make_plan(read_shape(p), ctx, parallel, page_size)
    if os.sep in target and (target.startswith((".", "/", "~")) or target.endswith(".gguf")):
        raise PlanError(f"no such file: {target}")
    blob = resolve_ollama_model(target, env)
    return make_plan(read_shape(blob), ctx, parallel, page_size, model=target)


def format_plan(plan: Plan) -> str:
    kv = plan.n_head_kv
    lines = [
        f"model      {plan.model}",
        f"file       {plan.path}",
        f"shape      {plan.arch}: {plan.n_layer} layers, n_embd {plan.n_embd}, {plan.n_head} heads, "
        f"{kv} KV heads, head dim K {plan.key_length} / V {plan.value_length}"
        + (f", trained context {plan.context_length}" if plan.context_length else ""),
        f"per token  {plan.elements_per_token:,} K+V elements over all layers",
        f"context    {plan.ctx:,} tokens x {plan.parallel} parallel = {plan.ctx * plan.parallel:,} cells; "
        f"page size {format_size(plan.page_size)}",
        "",
    ]
    header = ("cache", "bytes/token", "pages/1k tokens", "tokens/page", "KV memory", "in pages")
    rows = [
        (c.cache, f"{c.bytes_per_token:,} ({format_size(c.bytes_per_token)})", str(c.pages_per_1k_tokens), str(c.tokens_per_page),
         format_size(c.bytes), f"{c.pages:,} pages = {format_size(c.paged_bytes)}")
        for c in plan.caches
    ]
    lines += table(header, rows)
    return "\n".join(lines)


def table(header: tuple[str, ...], rows: list[tuple[str, ...]], right: set[int] | None = None) -> list[str]:
    """Plain aligned columns; numeric-looking columns are right-aligned."""
    cols = list(zip(header, *rows)) if rows else [(h,) for h in header]
    widths = [max(len(str(x)) for x in col) for col in cols]
    right = right if right is not None else {i for i in range(len(header)) if i > 0}
    out = []
    for r in [header, *rows]:
        cells = [str(x).rjust(w) if i in right else str(x).ljust(w) for i, (x, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return out
