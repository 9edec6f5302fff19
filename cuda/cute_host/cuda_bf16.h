#pragma once
// Host-emulator stand-in for cuda_bf16.h: __nv_bfloat16 itself comes from emu/emu.cuh.
struct __nv_bfloat16_raw {
  unsigned short x;
  __nv_bfloat16_raw() = default;
  __nv_bfloat16_raw(__nv_bfloat16 b) : x(b.__x) {}
};
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;
