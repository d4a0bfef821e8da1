/* The attention of cpu_attention.c over a bfloat16 KV cache */
#define KV_BF16 1
#include "cpu_attention.c"
