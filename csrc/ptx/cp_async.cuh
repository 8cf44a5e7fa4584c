// PTX wrappers for the Ampere-style asynchronous 16-byte copies (cp.async) into shared memory.
#pragma once

#include "ptx/tma.cuh"  // smem_addr

namespace mok {

__device__ __forceinline__ void cp_async16(void* smem_dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(smem_dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
// 16 bytes, or 16 zero bytes when `bytes` is 0 (nothing read: `src` need only be a valid address).
__device__ __forceinline__ void cp_async16_zfill(void* smem_dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(smem_dst)),
               "l"(src), "r"(bytes)
               : "memory");
}
// One arrival on `bar` once every cp.async this thread issued before it has landed (counted in
// the barrier's expected arrivals: the .noinc form).
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar))
               : "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

}  // namespace mok
