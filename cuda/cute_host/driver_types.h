#pragma once
// Host-emulator stand-in for driver_types.h: CUTLASS's host adapter only names these.
typedef struct CUstream_st* cudaStream_t;
typedef int cudaError_t;
