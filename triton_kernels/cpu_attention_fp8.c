/* The attention of cpu_attention.c over a float8 (e4m3fn) KV cache */
#define KV_FP8 1
#include "cpu_attention.c"
