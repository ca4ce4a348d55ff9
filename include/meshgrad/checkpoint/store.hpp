// Sharded training checkpoints: what one is on disk, and the whole API in one include. Every rank
// writes its own pieces of the training state in parallel, a manifest says which file holds which
// box of which tensor with hashes (SHA-256 per file, XXH3-128 per piece), directories are committed
// atomically, and a checkpoint loads on any other mesh (resharding) reading only the pieces a rank
// needs.
//
// On disk, ROOT/step_00000100/ holds
//   manifest.json        {"format": "meshgrad-checkpoint", "version": 1, "step": 100, "mesh": "dp=2,tp=2",
//                         "state": {...the trainer's: configuration, data position, RNG, ...},
//                         "files": [{"name": "rank_00000.bin", "bytes": N, "sha256": "..."}, ...],
//                         "tensors": [{"name": "h.0.attn.c_attn.weight", "dtype": "float32", "shape": [C, 3C],
//                                      "pieces": [{"file": 0, "offset": 0, "box": [[0, C], [0, 64]],
//                                                  "xxh3": "..."}, ...]}, ...]}
//   rank_RRRRR.bin       the raw bytes (row-major, the tensor's dtype, native little-endian) of the
//                        pieces rank R wrote, back to back at the manifest's offsets; a rank with
//                        several cores to itself spreads them over rank_RRRRR_F.bin, F = 0, 1, ...,
//                        written and hashed by one thread each
// A box is one [offset, size) range per dim of the full tensor. Every element of every tensor lies in
// exactly one piece (checked when a manifest is read). A piece replicated on several ranks (over dp,
// or a parameter replicated over tp) is written once, by one of its holders chosen round-robin so the
// bytes spread over the ranks.
//
// The parts, each usable on its own:
//   manifest.hpp         the manifest: parsing, validation, JSON
//   directory.hpp        checkpoint directories under a root: names, finding them, their manifest
//   saver.hpp            CheckpointSaver: writing a checkpoint, and the commit protocol
//   reader.hpp           reading pieces on any mesh, and whole tensors
//   verify.hpp           checking every file and piece against the manifest
//   staging_buffers.hpp  the memory saves and loads stage their transfers in
#pragma once

#include "meshgrad/checkpoint/directory.hpp"
#include "meshgrad/checkpoint/manifest.hpp"
#include "meshgrad/checkpoint/reader.hpp"
#include "meshgrad/checkpoint/saver.hpp"
#include "meshgrad/checkpoint/staging_buffers.hpp"
#include "meshgrad/checkpoint/state_tensor.hpp"
#include "meshgrad/checkpoint/verify.hpp"
