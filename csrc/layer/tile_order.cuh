// The fused layer's fixed tile order: tile kinds, the segments (shared expert, then the routed
// gate/up and down tiles minibatch by minibatch) and the forward-only cursor every worker thread
// walks it with.
#pragma once

#include "layer/sm90_gemm.cuh"

namespace mok {

enum TileKind : int { kTileSharedGU = 0, kTileSharedDN, kTileGU, kTileDN };

// The fixed tile order, walked forward by every worker thread that needs it.
struct TileOrder {
  int num_rows;        // P: padded receive rows
  int mb_rows;         // minibatch rows
  int num_mbs;         // minibatches holding rows
  int shared_rbs;      // shared expert row blocks
  int n_shared_gu, n_gu, n_dn;  // column tiles per row block
  bool interleave;     // GU(m) before DN(m-1) (needs two ring slots)

  // Segments: 0 shared GU, 1 shared DN, then 2 + s for the routed sequence.
  __device__ int num_segments() const { return 2 + 2 * num_mbs; }
  __device__ int mb_row_blocks(int mb) const {
    const int rows = min(mb_rows, num_rows - mb * mb_rows);
    return rows > 0 ? (rows + kTileM - 1) / kTileM : 0;  // a last block may hold 64 rows
  }
  // Kind and minibatch of segment s >= 2.
  __device__ void routed(int s, int& kind, int& mb) const {
    const int i = s - 2;
    if (!interleave) {
      kind = (i % 2) ? kTileDN : kTileGU;
      mb = i / 2;
      return;
    }
    if (i == 0) {
      kind = kTileGU, mb = 0;
    } else if (i == 2 * num_mbs - 1) {
      kind = kTileDN, mb = num_mbs - 1;
    } else {
      kind = (i % 2) ? kTileGU : kTileDN;
      mb = (i % 2) ? (i + 1) / 2 : i / 2 - 1;
    }
  }
  __device__ int segment_tiles(int s) const {
    if (s == 0) return shared_rbs * n_shared_gu;
    if (s == 1) return shared_rbs * n_dn;
    int kind, mb;
    routed(s, kind, mb);
    return mb_row_blocks(mb) * (kind == kTileGU ? n_gu : n_dn);
  }
};

struct Tile {
  int kind, mb, rb, nb;  // rb: global row block (receive rows rb * 128..) or shared row block
};

// Forward-only cursor over the tile order.
struct TileCursor {
  const TileOrder& o;
  int seg = 0, seg_start = 0, seg_len;
  __device__ explicit TileCursor(const TileOrder& order) : o(order) {
    seg_len = o.segment_tiles(0);
  }
  // False when t is past the last tile.
  __device__ bool find(int t, Tile& tile) {
    while (t >= seg_start + seg_len) {
      seg_start += seg_len;
      if (++seg >= o.num_segments()) return false;
      seg_len = o.segment_tiles(seg);
    }
    const int i = t - seg_start;
    if (seg < 2) {
      const int cols = seg == 0 ? o.n_shared_gu : o.n_dn;
      tile = Tile{seg == 0 ? kTileSharedGU : kTileSharedDN, -1, i / cols, i % cols};
      return true;
    }
    int kind, mb;
    o.routed(seg, kind, mb);
    const int cols = kind == kTileGU ? o.n_gu : o.n_dn;
    tile = Tile{kind, mb, mb * (o.mb_rows / kTileM) + i / cols, i % cols};
    return true;
  }
};

}  // namespace mok
