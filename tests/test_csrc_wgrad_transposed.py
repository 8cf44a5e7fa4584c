"""The transposed weight-gradient staging (csrc/layer/sm90_bwd.cuh ``wgrad_stage_t``,
``wgrad_stage_f32_t``) on the CPU: a host program built from the same header places every
element of a consumer warpgroup's accumulator chunk by ``wgrad_t_bf16_at`` / ``wgrad_t_f32_at``
(stepping ``kWgradTStep`` per column group, as the kernel does) and reads the staged buffer back
the way a 64-row TMA box in the 128-byte swizzle does (row r at 128 r, 16-byte unit u at
u ^ (r % 8)).

Checked: every element lands once, at C^T's row n and column m of its box (bf16: rows 0..63 and
64..127 of the chunk in boxes 0 and 1, columns m; fp32: columns 0..31 and 32..63 in boxes 0 and
1), nothing else is written, and each store instruction's 32 lanes hit 32 distinct banks. The
bf16 words' exchange between lanes l and l ^ 4 (which element each half holds) is mirrored from
``wgrad_stage_t`` here, so a change there must be made here too; the places come from the header.
What this cannot show is the TMA's own behaviour (the map, the box coordinates): the GPU tests
in tests/test_mok_backward_kernel_gpu.py check those against an fp64 oracle. Needs nvcc (skipped
where it is missing).
"""

from __future__ import annotations

import pytest

from tests.host_program import NVCC, run_host_program

pytestmark = pytest.mark.skipif(NVCC is None, reason="needs nvcc (builds a host program)")

PROGRAM = r"""
#include <cstdint>
#include <cstdio>
#include <vector>

#include "layer/sm90_bwd.cuh"

using namespace mok;

static int fails = 0;
#define CHECK(cond, ...)                 \
  do {                                   \
    if (!(cond)) {                       \
      if (++fails <= 20) {               \
        std::printf("FAIL: " __VA_ARGS__); \
        std::printf("\n");               \
      }                                  \
    }                                    \
  } while (0)

// element (m, n) of a warpgroup's 64 x 128 accumulator chunk, +1 (0: nothing)
static int id(int m, int n) { return 1 + m * 128 + n; }

// the byte of a 64-row box of 128-byte rows in the 128-byte swizzle: row r, byte c of the row
static int swizzled(int r, int c) { return r * 128 + (((c / 16) ^ (r % 8)) << 4) + c % 16; }

// __byte_perm(x, y, s): result byte i is byte (s >> 4 i) & 7 of {y, x} (x bytes 0..3)
static uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t v = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= ((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}

// the element thread tid holds at accumulator index i of a chunk: rows 16 w + l / 4 (+ 8 hr),
// columns 8 j + 2 (l % 4) (+ q), i = 4 j + 2 hr + q
static void held(int tid, int i, int& m, int& n) {
  const int w = tid / 32, l = tid % 32, j = i / 4, hr = (i / 2) % 2, q = i % 2;
  m = 16 * w + l / 4 + 8 * hr;
  n = 8 * j + 2 * (l % 4) + q;
}

static void check_banks(const std::vector<int>& addr, const char* what, int a, int b) {
  bool seen[32] = {};
  for (int t = 0; t < 32; ++t) {
    const int bank = (addr[t] / 4) % 32;
    CHECK(!seen[bank], "%s (%d, %d): two lanes in bank %d", what, a, b, bank);
    seen[bank] = true;
  }
}

static void bf16() {
  std::vector<int> buf(kEpiBytes / 2, 0);  // 16-bit slots
  for (int w = 0; w < 4; ++w) {
    for (int j = 0; j < 16; ++j) {
      // the kernel's c0 / c1 per lane, as element ids in 16-bit halves
      uint32_t c0[32], c1[32];
      for (int l = 0; l < 32; ++l) {
        const int tid = 32 * w + l;
        int m0, n0, m1, n1;
        held(tid, 4 * j, m0, n0), held(tid, 4 * j + 2, m1, n1);
        c0[l] = id(m0, n0) | (id(m1, n1) << 16);
        held(tid, 4 * j + 1, m0, n0), held(tid, 4 * j + 3, m1, n1);
        c1[l] = id(m0, n0) | (id(m1, n1) << 16);
      }
      for (int hr = 0; hr < 2; ++hr) {
        std::vector<int> addr(32);
        for (int l = 0; l < 32; ++l) {
          const int tid = 32 * w + l;
          const bool o = (tid / 4) % 2 != 0;
          const uint32_t sel = hr == 0 ? (o ? 0x1054u : 0x5410u) : (o ? 0x3276u : 0x7632u);
          const int p = l ^ 4;  // __shfl_xor_sync(.., 4)
          const uint32_t got = (p / 4) % 2 != 0 ? c0[p] : c1[p];
          const uint32_t keep = o ? c1[l] : c0[l];
          const uint32_t word = byte_perm(keep, got, sel);
          const int at = wgrad_t_bf16_at(tid, hr) + j * kWgradTStep;
          addr[l] = at;
          CHECK(at % 4 == 0 && at >= 0 && at + 4 <= kEpiBytes, "bf16 word %d out of place", at);
          for (int h = 0; h < 2; ++h) {
            int& slot = buf[at / 2 + h];
            CHECK(slot == 0, "bf16 slot %d written twice", at / 2 + h);
            slot = static_cast<int>((word >> (16 * h)) & 0xffff);
          }
        }
        check_banks(addr, "bf16 store (warp, j)", w, 2 * j + hr);
      }
    }
  }
  // read back as the TMA does: box b, row r (C^T row 64 b + r), column c (m)
  for (int b = 0; b < 2; ++b)
    for (int r = 0; r < 64; ++r)
      for (int c = 0; c < 64; ++c) {
        const int byte = b * kWgradBoxBytes + swizzled(r, 2 * c);
        CHECK(buf[byte / 2] == id(c, 64 * b + r), "bf16 box %d row %d col %d holds %d", b, r,
              c, buf[byte / 2]);
      }
}

static void f32() {
  for (int hh = 0; hh < 2; ++hh) {
    std::vector<int> buf(kEpiBytes / 4, 0);
    for (int w = 0; w < 4; ++w)
      for (int jj = 0; jj < 8; ++jj)
        for (int hr = 0; hr < 2; ++hr)
          for (int q = 0; q < 2; ++q) {
            std::vector<int> addr(32);
            for (int l = 0; l < 32; ++l) {
              const int tid = 32 * w + l;
              int m, n;
              held(tid, 4 * (8 * hh + jj) + 2 * hr + q, m, n);
              const int at = wgrad_t_f32_at(tid, hr, q) + jj * kWgradTStep;
              addr[l] = at;
              CHECK(at % 4 == 0 && at >= 0 && at + 4 <= kEpiBytes, "f32 word %d out of place", at);
              CHECK(buf[at / 4] == 0, "f32 word %d written twice", at);
              buf[at / 4] = id(m, n - 64 * hh);
            }
            check_banks(addr, "f32 store (warp, jj hr q)", w, 4 * jj + 2 * hr + q);
          }
    for (int b = 0; b < 2; ++b)
      for (int r = 0; r < 64; ++r)
        for (int c = 0; c < 32; ++c) {
          const int byte = b * kWgradBoxBytes + swizzled(r, 4 * c);
          CHECK(buf[byte / 4] == id(32 * b + c, r), "f32 half %d box %d row %d col %d holds %d",
                hh, b, r, c, buf[byte / 4]);
        }
  }
}

int main() {
  static_assert(2 * kWgradBoxBytes == kEpiBytes, "a chunk is two boxes");
  bf16();
  f32();
  std::printf("%s\n", fails == 0 ? "OK" : "FAILED");
  return fails == 0 ? 0 : 1;
}
"""


def test_transposed_staging_places_every_element_once_without_bank_conflicts(tmp_path):
    run = run_host_program(PROGRAM, tmp_path, "staging")
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stdout[-3000:]
