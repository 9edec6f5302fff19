#pragma once
// Host-emulator stand-in for cuda_fp16.h: storage types only (CUTLASS converts in software on the host).
struct __half_raw { unsigned short x; };
struct __half {
  unsigned short __x;
  __half() = default;
  __half(__half_raw r) : __x(r.x) {}
  operator __half_raw() const { return __half_raw{__x}; }
};
struct __half2 { __half x, y; };
typedef __half half;
typedef __half2 half2;
#include <cstring>
inline float __half2float(__half h) {  // IEEE binary16 -> binary32, exact
  const unsigned int s = (h.__x & 0x8000u) << 16, e = (h.__x >> 10) & 0x1Fu, m = h.__x & 0x3FFu;
  unsigned int u;
  if (e == 0x1F) u = s | 0x7F800000u | (m << 13);
  else if (e != 0) u = s | ((e + 112u) << 23) | (m << 13);
  else if (m == 0) u = s;
  else { float f = static_cast<float>(m) * 5.9604644775390625e-8f; std::memcpy(&u, &f, 4); u |= s; }
  float f; std::memcpy(&f, &u, 4); return f;
}
__half __float2half(float f);  // declared only: the emulator build never converts through __half
