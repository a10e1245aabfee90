// cuDNN, opened at run time (dlopen) on first use instead of linked, as cuBLAS is
// (layers/cuda/library.h): a CPU job, or a GPU job on cuBLAS convolutions, never loads it.
// The functions of cuDNN's legacy convolution API that layers/cuda/cudnn_conv2d.cc calls.
// cuDNN 9 marks that API deprecated but ships it (PyTorch's fallback path uses the same calls).
#pragma once

#include <cudnn.h>

namespace pipesgd::cuda {

struct CudnnApi {
  decltype(&cudnnGetVersion) get_version;
  decltype(&cudnnGetErrorString) error_string;
  decltype(&cudnnCreate) create;
  decltype(&cudnnDestroy) destroy;
  decltype(&cudnnSetStream) set_stream;
  decltype(&cudnnCreateTensorDescriptor) create_tensor;
  decltype(&cudnnSetTensor4dDescriptor) set_tensor_4d;
  decltype(&cudnnDestroyTensorDescriptor) destroy_tensor;
  decltype(&cudnnCreateFilterDescriptor) create_filter;
  decltype(&cudnnSetFilter4dDescriptor) set_filter_4d;
  decltype(&cudnnDestroyFilterDescriptor) destroy_filter;
  decltype(&cudnnCreateConvolutionDescriptor) create_convolution;
  decltype(&cudnnSetConvolution2dDescriptor) set_convolution_2d;
  decltype(&cudnnSetConvolutionMathType) set_convolution_math_type;
  decltype(&cudnnDestroyConvolutionDescriptor) destroy_convolution;
  decltype(&cudnnGetConvolution2dForwardOutputDim) forward_output_dim;
  decltype(&cudnnGetConvolutionForwardAlgorithm_v7) forward_algorithms;
  decltype(&cudnnGetConvolutionBackwardDataAlgorithm_v7) backward_data_algorithms;
  decltype(&cudnnGetConvolutionBackwardFilterAlgorithm_v7) backward_filter_algorithms;
  decltype(&cudnnConvolutionForward) forward;
  decltype(&cudnnConvolutionBackwardData) backward_data;
  decltype(&cudnnConvolutionBackwardFilter) backward_filter;
  decltype(&cudnnConvolutionBackwardBias) backward_bias;
  decltype(&cudnnAddTensor) add_tensor;
};

// The loaded API (loaded once, thread-safe). Throws Error(kUnavailable) naming the library
// (libcudnn.so.<major>) and the loader's reason when it cannot be opened or lacks a symbol, or
// when the library's major version is not the one this was built with.
const CudnnApi& Cudnn();

// Throws Error(kInternal) "cuDNN call <call> failed on device <device>: <status string>" for a
// status other than CUDNN_STATUS_SUCCESS; kIo for CUDNN_STATUS_ALLOC_FAILED.
void CheckCudnn(cudnnStatus_t status, const char* call, int device);
#define PSGD_CUDNN(call) ::pipesgd::cuda::CheckCudnn((call), #call, device)

}  // namespace pipesgd::cuda
