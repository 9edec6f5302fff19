#pragma once
// Host-emulator stand-in for cuComplex.h (CUTLASS's complex<T> converts from these).
struct alignas(8) cuFloatComplex { float x, y; };
struct alignas(16) cuDoubleComplex { double x, y; };
inline float cuCrealf(cuFloatComplex z) { return z.x; }
inline float cuCimagf(cuFloatComplex z) { return z.y; }
inline double cuCreal(cuDoubleComplex z) { return z.x; }
inline double cuCimag(cuDoubleComplex z) { return z.y; }
inline cuFloatComplex make_cuFloatComplex(float r, float i) { return {r, i}; }
inline cuDoubleComplex make_cuDoubleComplex(double r, double i) { return {r, i}; }
