#pragma once
// Host-emulator stand-in for CUDA's vector_types.h: the vector types CUTLASS names that
// emu/emu.cuh does not define (it defines uint3, dim3, float2, float4, int2, double2).
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(16) long4 { long x, y, z, w; };
struct alignas(16) ulong4 { unsigned long x, y, z, w; };
struct alignas(16) longlong2 { long long x, y; };
struct alignas(16) ulonglong2 { unsigned long long x, y; };
struct alignas(16) longlong4 { long long x, y, z, w; };
struct alignas(16) ulonglong4 { unsigned long long x, y, z, w; };
struct alignas(16) double4 { double x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
