"""Strict loading of a checkpoint's vision parts (its tower, and its projector where it has one), the same for every
family: the safetensors headers are read first, every stored name is mapped to the name of the module built from
config.json, and a missing, unexpected or mis-shaped tensor is refused, by name and file, before one tensor is read.
Only the vision parts' tensors are read; the language model's are never opened (nor its quantization scheme
looked at). Nothing is left at its random init: the load is strict.

A family states how its checkpoints name their vision tensors as `Layout`s (the released one first, then the names
transformers holds them under) and builds its parts from config.json; `load_weights` does the rest. The same
tables, read backwards, write the tiny checkpoints in the released layout (`write_weights`).
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from batchvlm.config import ConfigError

INDEX = "model.safetensors.index.json"
BLOCK = "{}"
"""In a prefix, a block's number."""
SHOWN = 8
"""Names shown per kind of problem."""


class CheckpointError(ConfigError):
    """The checkpoint's tensors do not fit the modules its config.json describes."""


@dataclass(frozen=True)
class Rename:
    """A prefix of the names in a checkpoint file and the prefix(es) of the module's names it stands for (`{}` is a
    block's number). Several module prefixes: the stored tensor holds their tensors stacked along dim 0, in that order
    (a fused qkv). `interleaved_heads`: the first two of those are rotary projections stored with each head's rotation
    pairs interleaved (x0 y0 x1 y1 ...), where the module rotates halves (x0 x1 ... y0 y1 ...)."""

    stored: str
    module: str | tuple[str, ...]
    interleaved_heads: int = 0

    @property
    def targets(self) -> tuple[str, ...]:
        return self.module if isinstance(self.module, tuple) else (self.module,)

    def module_names(self, name: str) -> tuple[str, ...] | None:
        """The module's names a stored name stands for; None where this rename does not apply to it."""
        found = _pattern(self.stored).match(name)
        if found is None:
            return None
        return tuple(target.format(*found.groups()) + name[found.end():] for target in self.targets)

    def stored_name(self, name: str) -> tuple[str, int] | None:
        """The stored name of a module's name, and which of the stored tensor's parts it is."""
        for part, target in enumerate(self.targets):
            if (found := _pattern(target).match(name)) is not None:
                return self.stored.format(*found.groups()) + name[found.end():], part
        return None

    def split(self, tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """A stored tensor cut into the module's tensors (rows `sizes`)."""
        if len(sizes) == 1:
            return [tensor]
        pieces = list(torch.split(tensor, sizes))
        if self.interleaved_heads:
            pieces[:2] = [_pairs_to_halves(piece, self.interleaved_heads) for piece in pieces[:2]]
        return [piece.contiguous() for piece in pieces]

    def join(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The module's tensors stacked as this rename stores them (the inverse of split)."""
        if self.interleaved_heads:
            pieces = [_halves_to_pairs(piece, self.interleaved_heads) for piece in pieces[:2]] + pieces[2:]
        return torch.cat(pieces).contiguous()


@dataclass(frozen=True)
class Layout:
    """How one publisher names the vision tensors: the renames, and the prefixes under which every name belongs to the
    vision parts (a name there that no rename maps is unexpected, not ignored)."""

    name: str
    roots: tuple[str, ...]
    renames: tuple[Rename, ...]

    def stored_name(self, name: str) -> tuple[Rename, str, int] | None:
        for rename in _specific_first(self.renames):
            if (stored := rename.stored_name(name)) is not None:
                return rename, *stored
        return None


@dataclass(frozen=True)
class Stored:
    """A tensor as its file's header describes it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    file: str


@dataclass(frozen=True)
class Source:
    """Where a module's tensor is stored: which tensor, read with which rename, which of its parts."""

    stored: Stored
    rename: Rename
    part: int
    layout: str


@dataclass(frozen=True)
class Checked:
    """What the headers held, once they fit the modules: each module tensor's source."""

    folder: Path
    sources: dict[str, Source]
    layouts: tuple[Layout, ...]

    @cached_property
    def stored(self) -> list[Stored]:
        return list({source.stored.name: source.stored for source in self.sources.values()}.values())

    def describe(self) -> str:
        files = sorted({stored.file for stored in self.stored})
        layouts = Counter(source.layout for source in self.sources.values())
        dtypes = sorted({stored.dtype for stored in self.stored})
        return (f"{len(self.stored)} vision tensors in {len(files)} file(s) ({', '.join(files)}), "
                f"{' and '.join(layouts)} layout, {'/'.join(dtypes)}: every one present, "
                "none unexpected, each of the shape config.json gives")


def load_weights(folder: Path, layouts: tuple[Layout, ...], parts: dict[str, torch.nn.Module],
                 read: bool = True) -> Checked:
    """Check the checkpoint's vision tensors against `parts` (module-name prefix -> module, built from config.json)
    from the headers alone, then, with `read`, read those tensors (and only those) into the parts, strictly.
    A checkpoint that does not fit is refused, naming the tensors and their file, before any tensor is read."""
    expected = {prefix + name: tuple(tensor.shape) for prefix, module in parts.items()
                for name, tensor in module.state_dict().items()}
    checked = check_weights(folder, layouts, expected)
    if read:
        tensors = _read(checked, expected)
        for prefix, module in parts.items():
            module.load_state_dict({name[len(prefix):]: tensor for name, tensor in tensors.items()
                                    if name.startswith(prefix)}, strict=True)
    return checked


def check_weights(folder: Path, layouts: tuple[Layout, ...], expected: dict[str, tuple[int, ...]]) -> Checked:
    """Every expected module tensor found once, with its shape; no other tensor under the layouts' roots."""
    renames = [(rename, layout.name) for layout in layouts for rename in layout.renames]
    renames.sort(key=lambda pair: len(pair[0].stored), reverse=True)  # the most specific prefix first
    roots = tuple(root for layout in layouts for root in layout.roots)
    sources: dict[str, Source] = {}
    unexpected, shapes, twice = [], [], []
    for stored in stored_tensors(folder, lambda name: name.startswith(roots)).values():
        mapped = next(((rename, layout, names) for rename, layout in renames
                       if (names := rename.module_names(stored.name)) is not None), None)
        if mapped is None or any(name not in expected for name in mapped[2]):
            unexpected.append(stored)
            continue
        rename, layout, names = mapped
        if (want := stacked([expected[name] for name in names])) != stored.shape:
            shapes.append((stored, want))
        for part, name in enumerate(names):
            if name in sources:
                twice.append((stored, sources[name].stored))
            sources[name] = Source(stored, rename, part, layout)
    missing = sorted(_stored_names([name for name in expected if name not in sources], layouts, sources))
    problems = ([f"missing: {name}" for name in missing] + [f"unexpected: {s.name} in {s.file}" for s in unexpected]
                + [f"shape: {s.name} in {s.file} is {list(s.shape)}, config.json makes it {list(want)}"
                   for s, want in shapes]
                + [f"twice: {s.name} in {s.file} and {other.name} in {other.file}" for s, other in twice])
    if problems:
        shown = problems[:SHOWN * 4] + ([f"... and {len(problems) - SHOWN * 4} more"] if len(problems) > SHOWN * 4
                                        else [])
        raise CheckpointError(f"model.path={folder}: the checkpoint's vision tensors do not fit the modules its "
                              "config.json describes (nothing was run):\n  " + "\n  ".join(shown))
    return Checked(folder, sources, layouts)


def stacked(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of tensors stacked along dim 0 (one tensor: its own)."""
    if len(shapes) == 1:
        return shapes[0]
    if len({shape[1:] for shape in shapes}) != 1:
        return ()  # not stackable: fits no stored shape
    return (sum(shape[0] for shape in shapes), *shapes[0][1:])


def _stored_names(names: list[str], layouts: tuple[Layout, ...], sources: dict[str, Source]) -> set[str]:
    """Module names as the checkpoint's own layout (the one most of its tensors use; else the released one) stores
    them: what a user looks for in the file."""
    used = Counter(source.layout for source in sources.values())
    layout = max(layouts, key=lambda candidate: used[candidate.name]) if used else layouts[0]
    return {found[1] if (found := layout.stored_name(name)) else name for name in names}


def stored_tensors(folder: Path, keep) -> dict[str, Stored]:
    """The tensors whose names `keep` accepts, from the safetensors headers: with an index, only the files that hold
    one of them are opened (a VLM's language model is most of its files)."""
    from safetensors import safe_open

    index = folder / INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        listed = {name: file for name, file in weight_map.items() if keep(name)}
        files = sorted(set(listed.values()))
    else:
        listed, files = None, sorted(path.name for path in folder.glob("*.safetensors"))
    found = {}
    for file in files:
        with safe_open(folder / file, framework="pt") as header:  # reads the header, maps no tensor
            for name in header.keys():
                if keep(name) and (listed is None or listed.get(name) == file):
                    tensor = header.get_slice(name)
                    found[name] = Stored(name, tuple(tensor.get_shape()), tensor.get_dtype(), file)
    if listed is not None and (absent := sorted(set(listed) - set(found))):
        raise CheckpointError(f"model.path={folder}: {INDEX} lists {', '.join(absent[:SHOWN])} in files that do not "
                              "hold them")
    return found


def _read(checked: Checked, expected: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The module tensors by module name, read from their files (each file opened once)."""
    from safetensors import safe_open

    targets: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for name, source in checked.sources.items():
        targets[source.stored.name].append((source.part, name))
    renames = {source.stored.name: source.rename for source in checked.sources.values()}
    by_file = defaultdict(list)
    for stored in checked.stored:
        by_file[stored.file].append(stored.name)
    tensors = {}
    for file, stored_names in by_file.items():
        with safe_open(checked.folder / file, framework="pt") as opened:
            for stored in stored_names:
                names = [name for _, name in sorted(targets[stored])]
                pieces = renames[stored].split(opened.get_tensor(stored), [expected[name][0] for name in names])
                tensors.update(zip(names, pieces))
    return tensors


def released_tensors(layout: Layout, parts: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The parts' tensors under the layout's names, fused ones stacked as it stores them (the inverse of reading);
    on the meta device, their shapes alone."""
    grouped: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    renames = {}
    for prefix, module in parts.items():
        for name, tensor in module.state_dict().items():
            found = layout.stored_name(prefix + name)
            if found is None:
                raise ValueError(f"the {layout.name} layout names no {prefix + name}")
            rename, stored, part = found
            grouped[stored][part] = tensor.detach()
            renames[stored] = rename
    return {stored: renames[stored].join([pieces[part] for part in sorted(pieces)])
            for stored, pieces in grouped.items()}


def write_weights(path: Path, layout: Layout, parts: dict[str, torch.nn.Module],
                  extra: dict[str, torch.Tensor] | None = None) -> None:
    """The parts' tensors under the layout's names, and `extra` tensors (a language model) as they are named, in one
    safetensors file: a checkpoint as its publisher ships it."""
    from safetensors.torch import save_file

    tensors = released_tensors(layout, parts)
    tensors.update({name: tensor.detach().contiguous() for name, tensor in (extra or {}).items()})
    save_file(tensors, str(path), metadata={"format": "pt"})


def write_released(folder: Path, config: dict, layout: Layout, parts: dict[str, torch.nn.Module],
                   extra: dict[str, torch.Tensor]) -> None:
    """A checkpoint folder as its publisher ships one: config.json as given, and the parts' tensors (with `extra`)
    under the layout's names in model.safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_weights(folder / "model.safetensors", layout, parts, extra)


def nontrivial(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every tensor of `module` that its init left constant (a zero bias, a unit norm, a zero table) given values of
    its own, deterministically: in a tiny checkpoint, a tensor that fails to load then changes the output."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, tensor in sorted(module.state_dict().items()):
            if tensor.is_floating_point() and bool(tensor.min() == tensor.max()):
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator).to(tensor.dtype))
    return module


def _pattern(prefix: str) -> re.Pattern:
    return re.compile("^" + re.escape(prefix).replace(re.escape(BLOCK), r"(\d+)"))


def _specific_first(renames: tuple[Rename, ...]) -> list[Rename]:
    return sorted(renames, key=lambda rename: max(len(target) for target in rename.targets), reverse=True)


def _pairs_to_halves(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    rows = tensor.shape[0]
    return tensor.reshape(heads, rows // heads // 2, 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)


def _halves_to_pairs(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    rows = tensor.shape[0]
    return tensor.reshape(heads, 2, rows // heads // 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)
