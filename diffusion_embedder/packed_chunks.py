"""GradCache's chunks of a packed column: packed chunk by chunk at collation, cut by shape on the device.

GradCache runs a column in chunks of texts. Re-packing each chunk on the step would read the column back from the
device and copy every chunk to it again, a host synchronisation each; so the collator packs each chunk apart
(``pack_chunks``) into one tensor whose shape says where each chunk is, and ``split_packed`` cuts it by that shape
alone. A column packed any other way is read to the host once and packed again per chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffusion_embedder.packing import OFFSETS_KEY, PACKED_KEY, pack, unpack_sequences

#: The key of a column packed chunk by chunk (``pack_chunks``): its shape, (chunks, texts per chunk), is the layout
#: ``split_packed`` cuts by; its values (True for a text, False for an empty slot of the last chunk) are never read.
CHUNKS_KEY = "pack_chunks"
#: Each chunk's own ``cu_seq_lens`` in a column packed by ``pack_chunks``: (chunks, M), a row per chunk, shorter
#: rows ending in repeats of their last offset (empty sequences, which attend to nothing), so a chunk's offsets are
#: a row of a tensor, cut by shape like the rest.
CHUNK_OFFSETS_KEY = "chunk_cu_seq_lens"


def offsets_of(segments: torch.Tensor, longest: int) -> list[int]:
    """``pack``'s sequence boundaries of flattened rows, from their segment ids: each text (a run of one id >= 0),
    then the row's padding (negative ids) in pieces of at most ``longest`` tokens."""
    width = segments.shape[1]
    offsets = [0]
    for r, row in enumerate(segments.tolist()):
        start = 0
        while start < width:
            end = start + 1
            if row[start] >= 0:
                while end < width and row[end] == row[start]:
                    end += 1
            else:
                while end < width and row[end] < 0 and end - start < longest:
                    end += 1
            offsets.append(r * width + end)
            start = end
    return offsets


def segments_of(features: dict[str, torch.Tensor]) -> torch.Tensor:
    """The segment ids of host-side packed features (``pack``'s; rebuilt where ``pack`` left them out)."""
    if "segment_ids" in features:
        return features["segment_ids"]
    rows, width = features["input_ids"].shape
    segments = (-1 - torch.arange(width)).repeat(rows, 1).reshape(-1)
    for i, (index, mask) in enumerate(zip(features[PACKED_KEY], features["attention_mask"].bool(), strict=True)):
        segments[index[mask]] = i
    return segments.view(rows, width)


def pack_chunks(chunks: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Host-side packed features of consecutive chunks of texts (``pack``'s, one per chunk, all but the last of
    the same number of texts) laid one after another: each chunk in as many rows as the fullest (padding rows
    after), every row as wide as the widest, so chunk c is rows ``c*R`` to ``(c+1)*R`` and texts ``c*k`` to
    ``(c+1)*k``. ``split_packed`` then cuts it by shape alone, without reading the device (GradCache's chunks).
    """
    k = chunks[0]["attention_mask"].shape[0]
    rows = max(c["input_ids"].shape[0] for c in chunks)
    width = max(c["input_ids"].shape[1] for c in chunks)
    longest = max(c["attention_mask"].shape[1] for c in chunks)
    texts = sum(c["attention_mask"].shape[0] for c in chunks)
    input_ids = torch.zeros((len(chunks) * rows, width), dtype=torch.long)
    position_ids = torch.zeros_like(input_ids)
    segment_ids = (-1 - torch.arange(width)).repeat(len(chunks) * rows, 1)
    unpack_index = torch.zeros((texts, longest), dtype=torch.long)
    attention_mask, embed_mask = torch.zeros_like(unpack_index), torch.zeros_like(unpack_index)
    slots = torch.zeros((len(chunks), k), dtype=torch.bool)
    offsets: list[list[int]] = []
    for c, chunk in enumerate(chunks):
        r, w = chunk["input_ids"].shape
        n, t = chunk["attention_mask"].shape
        first, text = c * rows, c * k
        input_ids[first : first + r, :w] = chunk["input_ids"]
        position_ids[first : first + r, :w] = chunk["position_ids"]
        segment_ids[first : first + r, :w] = segments_of(chunk)
        index = chunk[PACKED_KEY]
        unpack_index[text : text + n] = first * width  # padding slots point at the chunk's first position
        unpack_index[text : text + n, longest - t :] = (first + index // w) * width + index % w
        attention_mask[text : text + n, longest - t :] = chunk["attention_mask"]
        embed_mask[text : text + n, longest - t :] = chunk["embed_mask"]
        slots[c, :n] = True
        offsets.append(offsets_of(segment_ids[first : first + rows], longest))
    size = rows * width
    flat = [o + c * size for c, chunk_offsets in enumerate(offsets) for o in chunk_offsets[:-1]] + [len(chunks) * size]
    per_chunk = [o + [o[-1]] * (max(map(len, offsets)) - len(o)) for o in offsets]
    return {"input_ids": input_ids, "position_ids": position_ids, "segment_ids": segment_ids,
            PACKED_KEY: unpack_index, "attention_mask": attention_mask, "embed_mask": embed_mask,
            OFFSETS_KEY: torch.tensor(flat, dtype=torch.int32),
            CHUNK_OFFSETS_KEY: torch.tensor(per_chunk, dtype=torch.int32), CHUNKS_KEY: slots}  # fmt: skip


def to_host(features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``features`` on the host in one device-to-host copy (one synchronisation, not one per tensor)."""
    flat = torch.cat([v.reshape(-1).long() for v in features.values()]).cpu()
    sizes = [v.numel() for v in features.values()]
    parts = flat.split(sizes)
    return {k: p.view(v.shape).to(v.dtype) for (k, v), p in zip(features.items(), parts, strict=True)}


def to_device(features: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Host tensors to ``device`` without waiting: to CUDA from pinned memory (no synchronisation)."""
    pinned = device.type == "cuda"
    return {k: (v.pin_memory() if pinned else v).to(device, non_blocking=True) for k, v in features.items()}


def split_packed(features: dict[str, torch.Tensor], chunk_size: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive chunks of ``chunk_size`` texts. A column packed by ``pack_chunks`` at this chunk size is cut by
    shape, on its device (no synchronisation); any other is read to the host once and each chunk packed again
    into rows as wide as the original's."""
    texts = features["attention_mask"].shape[0]
    if CHUNKS_KEY in features and features[CHUNKS_KEY].shape[1] == chunk_size:
        count = features[CHUNKS_KEY].shape[0]
        rows, width = features["input_ids"].shape[0] // count, features["input_ids"].shape[1]
        chunks = []
        for c in range(count):
            by_row, by_text = slice(c * rows, (c + 1) * rows), slice(c * chunk_size, min((c + 1) * chunk_size, texts))
            chunk = {k: features[k][by_row] for k in ("input_ids", "position_ids", "segment_ids") if k in features}
            chunk[PACKED_KEY] = features[PACKED_KEY][by_text] - c * rows * width
            chunk.update({k: features[k][by_text] for k in ("attention_mask", "embed_mask")})
            chunk[CHUNKS_KEY] = features[CHUNKS_KEY][c : c + 1]
            if CHUNK_OFFSETS_KEY in features:
                chunk[OFFSETS_KEY] = features[CHUNK_OFFSETS_KEY][c]
            chunks.append(chunk)
        return chunks
    device = features["input_ids"].device
    layout = (CHUNKS_KEY, CHUNK_OFFSETS_KEY)
    sequences = unpack_sequences(to_host({k: v for k, v in features.items() if k not in layout}))
    width = features["input_ids"].shape[1]
    pad = 0  # padding attends only to itself and is never pooled: its id changes nothing
    return [to_device(pack(sequences[start : start + chunk_size], width, pad), device)
            for start in range(0, len(sequences), chunk_size)]  # fmt: skip
