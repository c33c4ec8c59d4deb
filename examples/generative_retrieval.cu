// generative_retrieval built by nvcc: also trains and evaluates on the GPU (--device cuda).
#include "generative_retrieval.cpp"
