"""A checkpoint's tensors as the model names and shapes them, by transformers' own loading rules, read by range.

Note [Converted tensors read by range]
--------------------------------------
transformers 5 loads a checkpoint through rules it keeps per model (`get_model_conversion_mapping`): a
`WeightRenaming` changes a key (GPT-NeoX's `embed_out.` -> `lm_head.`); a `WeightConverter` makes model
tensors from file tensors by a chain of ops (Mixtral's per-expert `experts.N.w1/w3` stacked, then
concatenated into `experts.gate_up_proj`; a fused `qkv` chunked). from_pretrained runs the ops on whole
tensors; a rank here needs a few element ranges. So the same rules rename and group the keys as
from_pretrained does (`rename_source_key`, in `dot_natural_key` order), and the converter's own `convert`
runs on `ElementMap`s instead of values. An ElementMap of shape S says which file element each element
is (file tensor j's element e is base_j + e), keeping one int64 per run of consecutive numbers along the
last dimension. It answers torch.stack, cat, chunk, split, transpose and reshape by moving its starts as
the values would move, splitting runs only where an op cuts inside one: Mixtral's gate_up_proj
(E, 2I, H) costs E * 2I numbers. An op that computes values asks something the map does not answer, and
the load is refused naming it. Reading elements [lo, hi): the runs they cover become (file element,
length) segments, merged where they continue each other in the file, each read once in file order and
put in the tensor's order: every byte of a rank's part read once, from whichever file holds it.
"""
from __future__ import annotations

import copy
import math

import torch

from shardopt.weights.format import WeightFileError
from shardopt.weights.reader import WeightSource


class NotReadableByRange(TypeError):
    """A conversion op asked an ElementMap for something other than moving elements."""


def _meta(shape) -> torch.Tensor:
    return torch.empty(shape, device="meta")


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


class ElementMap:
    """Which file element each element of a tensor is (Note [Converted tensors read by range])."""

    def __init__(self, starts: torch.Tensor, run: int):
        self.starts, self.run = starts, run

    @classmethod
    def of_file_tensor(cls, base: int, shape: tuple) -> "ElementMap":
        if not shape:
            return cls(torch.tensor(base), 1)
        run = max(shape[-1], 1)
        return cls((base + torch.arange(0, math.prod(shape), run)).reshape(*shape[:-1], shape[-1] // run), run)

    @property
    def shape(self) -> torch.Size:
        if self.starts.dim() == 0:
            return torch.Size(())
        return torch.Size((*self.starts.shape[:-1], self.starts.shape[-1] * self.run))

    @property
    def ndim(self) -> int:
        return self.starts.dim()

    def dim(self) -> int:
        return self.starts.dim()

    def size(self, d: int | None = None):
        return self.shape if d is None else self.shape[d]

    def numel(self) -> int:
        return math.prod(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def finer(self, run: int) -> "ElementMap":
        """The same map with runs of `run` (a divisor of self.run)."""
        if run == self.run:
            return self
        starts = self.starts.unsqueeze(-1) + torch.arange(0, self.run, run)
        return ElementMap(starts.reshape(*self.starts.shape[:-1], -1), run)

    # the tensor methods conversion ops call
    def contiguous(self, *args, **kwargs) -> "ElementMap":
        return self

    clone = detach = contiguous

    def reshape(self, *shape, **kwargs) -> "ElementMap":
        shape = kwargs.get("shape", shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape)
        new = _meta(self.shape).reshape(shape).shape
        if not new:
            return ElementMap(self.finer(1).starts.reshape(()), 1)
        run = math.gcd(self.run, new[-1]) or 1
        return ElementMap(self.finer(run).starts.reshape(*new[:-1], new[-1] // run), run)

    view = reshape

    def transpose(self, dim0: int, dim1: int) -> "ElementMap":
        d0, d1 = _dim(dim0, self.ndim), _dim(dim1, self.ndim)
        last = self.ndim - 1
        m = self.finer(1) if last in (d0, d1) and d0 != d1 else self
        return ElementMap(m.starts.transpose(d0, d1), m.run)

    swapaxes = transpose

    def permute(self, *dims, **kwargs) -> "ElementMap":
        dims = kwargs.get("dims", dims[0] if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else dims)
        dims = tuple(_dim(d, self.ndim) for d in dims)
        m = self if not dims or dims[-1] == self.ndim - 1 else self.finer(1)
        return ElementMap(m.starts.permute(dims), m.run)

    def squeeze(self, dim: int | None = None) -> "ElementMap":
        return self.reshape(_meta(self.shape).squeeze(*(() if dim is None else (dim,))).shape)

    def unsqueeze(self, dim: int) -> "ElementMap":
        return self.reshape(_meta(self.shape).unsqueeze(dim).shape)

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> "ElementMap":
        return self.reshape(_meta(self.shape).flatten(start_dim, end_dim).shape)

    def split(self, split_size_or_sections, dim: int = 0):
        return _split(self, split_size_or_sections, dim, torch.split)

    def chunk(self, chunks: int, dim: int = 0):
        return _split(self, chunks, dim, torch.chunk)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotReadableByRange(f"tensor.{name}")

    def __getitem__(self, index):
        raise NotReadableByRange("indexing")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in ("stack", "cat", "concat", "concatenate"):
            return _join(*args, **kwargs, stacked=name == "stack")
        if name in ("split", "chunk", "transpose", "swapaxes", "permute", "reshape", "squeeze", "unsqueeze",
                    "flatten"):
            return getattr(args[0], name)(*args[1:], **kwargs)
        raise NotReadableByRange(f"torch.{name}")


def _computes(op: str):
    def refuse(self, *args, **kwargs):
        raise NotReadableByRange(op)
    return refuse


for _op in ("add", "sub", "mul", "truediv", "floordiv", "pow", "matmul", "neg", "abs"):
    for _name in (f"__{_op}__", f"__r{_op}__"):
        setattr(ElementMap, _name, _computes(_op))


def _join(tensors, dim: int = 0, *, stacked: bool) -> ElementMap:
    maps = list(tensors)
    ndim = maps[0].ndim + stacked
    d = _dim(dim, ndim)
    run = 1 if stacked and d == ndim - 1 else math.gcd(*(m.run for m in maps))
    parts = [m.finer(run).starts for m in maps]
    return ElementMap(torch.stack(parts, d) if stacked else torch.cat(parts, d), run)


def _split(m: ElementMap, arg, dim: int, how) -> tuple:
    d = _dim(dim, m.ndim)
    sizes = [p.shape[d] for p in how(_meta(m.shape), arg, d)]
    if d < m.ndim - 1:
        return tuple(ElementMap(s, m.run) for s in torch.split(m.starts, sizes, d))
    run = math.gcd(m.run, *sizes) or 1
    fine = m.finer(run)
    return tuple(ElementMap(s, run) for s in torch.split(fine.starts, [n // run for n in sizes], d))


class ConvertedTensor:
    """One model tensor made by a converter: its file tensors, in the order the ops took them, and where each
    of its runs of elements lies in them (merged segments, in the tensor's order)."""

    def __init__(self, keys: tuple, bases: torch.Tensor, dtypes: tuple, elements: ElementMap):
        self.keys, self.bases = keys, bases
        self.dtype = dtypes[0]
        for d in dtypes[1:]:
            self.dtype = torch.promote_types(self.dtype, d)
        self.shape = tuple(elements.shape)
        starts = elements.starts.contiguous().reshape(-1)
        self.starts, self.lengths = _merged(starts, torch.full_like(starts, elements.run), self._file_of(starts))
        self.at = torch.cumsum(self.lengths, 0) - self.lengths  # the tensor's element where each segment begins

    def segments(self, lo: int, hi: int) -> tuple:
        """(first file element, length) of the segments of elements [lo, hi), in the tensor's order."""
        i0 = int(torch.searchsorted(self.at, torch.tensor([lo]), right=True)) - 1
        i1 = int(torch.searchsorted(self.at, torch.tensor([hi])))
        starts, lengths = self.starts[i0:i1].clone(), self.lengths[i0:i1].clone()
        starts[0] += lo - self.at[i0]
        lengths[0] -= lo - self.at[i0]
        lengths[-1] -= self.at[i1 - 1] + self.lengths[i1 - 1] - hi
        return starts, lengths

    def _file_of(self, starts: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(self.bases, starts, right=True) - 1

    def read(self, files: WeightSource, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        """Elements [lo, hi) (Note [Converted tensors read by range]): each file range read once, in file order."""
        if hi <= lo:
            return torch.empty(0, dtype=dtype)
        starts, lengths = self.segments(lo, hi)
        order = torch.argsort(starts)
        in_file_order = bool((order == torch.arange(len(order))).all())
        s, n = (starts, lengths) if in_file_order else _merged(starts[order], lengths[order],
                                                                self._file_of(starts[order]))
        out = torch.empty(hi - lo, dtype=dtype)
        at = 0
        for start, length, j in zip(s.tolist(), n.tolist(), self._file_of(s).tolist()):
            base = int(self.bases[j])
            out[at:at + length] = files.read(self.keys[j], start - base, start - base + length, dtype=dtype)
            at += length
        if in_file_order:
            return out
        # out holds the segments in file order; put them back in the tensor's order.
        sorted_at = torch.zeros_like(lengths)
        sorted_at[order] = torch.cumsum(lengths[order], 0) - lengths[order]
        tensor_at = torch.cumsum(lengths, 0) - lengths
        index = torch.repeat_interleave(sorted_at - tensor_at, lengths) + torch.arange(hi - lo)
        return out[index]


def _merged(starts: torch.Tensor, lengths: torch.Tensor, files: torch.Tensor) -> tuple:
    """Segments that continue one another in one file tensor, joined."""
    if len(starts) <= 1:
        return starts, lengths
    cut = (starts[:-1] + lengths[:-1] != starts[1:]) | (files[:-1] != files[1:])
    group = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(cut.long(), 0)])
    first = torch.cat([torch.ones(1, dtype=torch.bool), cut])
    return starts[first], torch.zeros(int(group[-1]) + 1, dtype=lengths.dtype).index_add_(0, group, lengths)


class ModelShapes:
    """What a conversion op may ask of the model (`get_parameter(name).shape`), at the model's true shapes."""

    def __init__(self, shapes: dict, config):
        self.shapes, self.config = shapes, config

    def get_parameter(self, name: str) -> torch.Tensor:
        return _meta(self.shapes[name])


class ModelView:
    """The file tensors under the names and shapes the model has (a WeightSource's interface): plain keys
    renamed as transformers renames them, converted tensors read through their ElementMaps."""

    def __init__(self, files: WeightSource, renamed: dict, converted: dict):
        self.files, self._renamed, self._converted = files, renamed, converted

    def names(self) -> list:
        return [*self._renamed, *self._converted]

    def __contains__(self, name) -> bool:
        return name in self._renamed or name in self._converted

    def shape(self, name: str) -> tuple:
        if name in self._converted:
            return self._converted[name].shape
        return self.files.shape(self._renamed[name])

    def dtype(self, name: str) -> torch.dtype:
        if name in self._converted:
            return self._converted[name].dtype
        return self.files.dtype(self._renamed[name])

    def read(self, name: str, lo: int = 0, hi: int | None = None, dtype: torch.dtype | None = None):
        if name not in self._converted:
            return self.files.read(self._renamed[name], lo, hi, dtype)
        t = self._converted[name]
        numel = math.prod(t.shape)
        hi = numel if hi is None else hi
        if not 0 <= lo <= hi <= numel:
            raise ValueError(f"elements [{lo}, {hi}) are outside {name!r}, which has {numel}")
        return t.read(self.files, lo, hi, dtype or t.dtype)

    def close(self) -> None:
        self.files.close()


def model_view(files: WeightSource, model, shapes: dict) -> ModelView | WeightSource:
    """`files` as `model` (a transformers PreTrainedModel) loads them; `shapes` {name: shape} are the model's
    tensors under its own state-dict names. Without rules that touch a key, `files` itself."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    except ImportError:  # a transformers without conversion rules loads keys as they are
        return files

    rules = get_model_conversion_mapping(model)
    renamings = [r for r in rules if isinstance(r, WeightRenaming)]
    converters = [c for c in rules if isinstance(c, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", "") or None
    renamed, groups = {}, {}
    # dot_natural_key's parts are ints and strings in some versions, tuples in others: never compared mixed.
    for key in sorted(files.names(), key=lambda k: [(not isinstance(p, int), p) for p in dot_natural_key(k)]):
        name, pattern = rename_source_key(key, renamings, converters, prefix, shapes)
        if name not in shapes and key in shapes:
            name, pattern = key, None
        if pattern is not None and name in shapes:
            groups.setdefault(name, (copy.deepcopy(by_pattern[pattern]), []))[1].append((key, pattern))
        elif pattern is None and name not in renamed:
            renamed[name] = key
        else:  # a converter's key for no model tensor, or a second key for one: unexpected, by its own name
            renamed[key if key not in renamed else f"{key} (beside {renamed[key]})"] = key
    if not groups and all(n == k for n, k in renamed.items()):
        return files
    converted = {}
    for first, (converter, keys) in groups.items():
        converted.update(converted_tensors(files, converter, first, keys, ModelShapes(shapes, model.config)))
    return ModelView(files, renamed, converted)


def converted_tensors(files: WeightSource, converter, first: str, keys: list, model: ModelShapes) -> dict:
    """{model name: ConvertedTensor} of one converter's group, `keys` its (file key, source pattern) pairs in
    transformers' order and `first` the name it is filed under: the converter's op chain run on ElementMaps."""
    bases, at = [], 0
    for key, pattern in keys:
        bases.append(at)
        converter.add_tensor(first, key, pattern, ElementMap.of_file_tensor(at, tuple(files.shape(key))))
        at += math.prod(files.shape(key))
    ops = ", ".join(type(op).__name__ for op in converter.operations)
    try:
        out = converter.convert(first, model=model, config=model.config)
    except NotReadableByRange as e:
        raise WeightFileError(f"{first!r} is made from {keys[0][0]!r} and {len(keys) - 1} more by transformers' "
                              f"{ops}, which computes values ({e}): it cannot be read by range. Load the model "
                              "with transformers' from_pretrained, save_weights it, and load that folder") from None
    except Exception as e:  # noqa: BLE001 - transformers' own check of the group (a missing expert, a shape)
        raise WeightFileError(f"{first!r}: transformers' {ops} refused the file tensors {[k for k, _ in keys]}: "
                              f"{type(e).__name__}: {e}") from None
    out = out[0] if isinstance(out, tuple) else out  # transformers < 5.2 returns (tensors, errors)
    key_names = tuple(k for k, _ in keys)
    dtypes = tuple(files.dtype(k) for k in key_names)
    starts = torch.tensor(bases)
    return {name: ConvertedTensor(key_names, starts, dtypes, m[0] if isinstance(m, list) else m)
            for name, m in out.items()}
