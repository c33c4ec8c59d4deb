// train_flipflop built by nvcc: also trains on the GPU (--device cuda).
#include "train_flipflop.cpp"
