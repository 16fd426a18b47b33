// Instantiation groups of the native varlen-M kernel, one translation unit each (src/cuda/gemm/instances/),
// so the build parallelises and a change to one epilogue recompiles few kernels.
#pragma once

#include "cuda/gemm/native_gemm.h"

namespace sonicmoe::cuda::gemm::detail {

// The signatures of the varlen-M instance groups, by argument struct G (NativeVarlenM here, Fp8VarlenM in
// fp8_instances.h): the function types that declare them (a definition spells its parameters out).
template <class G>
using StoreInstance = void(const G& g, __nv_bfloat16* c, const __nv_bfloat16* bias, const float* row_scale);
template <class G>
using ActivationInstance = void(const G& g, Activation act, const __nv_bfloat16* bias, __nv_bfloat16* z,
                                __nv_bfloat16* a_out);
template <class G>
using DgatedInstance = void(const G& g, Activation act, const __nv_bfloat16* z, const float* pair_score,
                            const std::int32_t* pair, __nv_bfloat16* dz, __nv_bfloat16* as, float* ds_partial);

StoreInstance<NativeVarlenM> native_store_contiguous, native_store_gathered;
ActivationInstance<NativeVarlenM> native_activation_glu, native_activation_plain;
DgatedInstance<NativeVarlenM> native_dgated_glu, native_dgated_plain;
// The same on the four-warpgroup layout (four gathering warps, a four-warp epilogue): for short K
// (heuristics.h, dgated_mma_gather).
DgatedInstance<NativeVarlenM> native_dgated_glu_wide, native_dgated_plain_wide;

void native_varlen_k_contiguous_p(const NativeVarlenK& g);
void native_varlen_k_gathered_p(const NativeVarlenK& g);
void native_varlen_k_gathered_p_tma_q(const NativeVarlenK& g);
// g already swapped (P gathered, Q contiguous); writes D^T of g, i.e. the caller's D.
void native_varlen_k_gathered_p_tma_q_transposed(const NativeVarlenK& g);

// W1 in two parts (concatenated or separate: MoEConfig::w1_layout, w1_layout_sm90.cuh; the strides in g), one file
// each: the up-projection of the glu activations (b1 in two parts too), dXe (B = W1 N-major, contiguous A, no bias),
// and dW1 written in two parts (the dW1 shape: P contiguous, Q gathered; the transposed one takes g already swapped).
void native_activation_glu_w1_concat(const NativeVarlenM& g, Activation act, const __nv_bfloat16* bias,
                                     __nv_bfloat16* z, __nv_bfloat16* a_out, W1BiasStrides bias_strides);
void native_store_contiguous_bkn_w1_concat(const NativeVarlenM& g, __nv_bfloat16* c);
void native_varlen_k_contiguous_p_w1_concat(const NativeVarlenK& g);
void native_varlen_k_gathered_p_tma_q_transposed_w1_concat(const NativeVarlenK& g);

// D += P^T Q into NativeVarlenK::d_f32 (VarlenKAccumF32Cfg): the four interleaved variants above from registers
// (varlen_k_accum.cu) or, the two that long-K weight gradients take, by TMA reduce-add (_tma, varlen_k_accum_tma.cu),
// and the two dW1 ones in two parts (varlen_k_accum_w1_concat.cu), by the same choice.
void native_varlen_k_contiguous_p_accum(const NativeVarlenK& g);
void native_varlen_k_gathered_p_accum(const NativeVarlenK& g);
void native_varlen_k_gathered_p_tma_q_accum(const NativeVarlenK& g);
void native_varlen_k_gathered_p_tma_q_transposed_accum(const NativeVarlenK& g);
void native_varlen_k_contiguous_p_w1_concat_accum(const NativeVarlenK& g);
void native_varlen_k_gathered_p_tma_q_transposed_w1_concat_accum(const NativeVarlenK& g);
void native_varlen_k_gathered_p_tma_q_accum_tma(const NativeVarlenK& g);
void native_varlen_k_gathered_p_tma_q_transposed_accum_tma(const NativeVarlenK& g);

// The same entry points instantiated for f16 operands (instances/f16/, instance_element.h).
StoreInstance<NativeVarlenM> native_store_contiguous_f16, native_store_gathered_f16;
ActivationInstance<NativeVarlenM> native_activation_glu_f16, native_activation_plain_f16;
DgatedInstance<NativeVarlenM> native_dgated_glu_f16, native_dgated_plain_f16;
DgatedInstance<NativeVarlenM> native_dgated_glu_wide_f16, native_dgated_plain_wide_f16;

void native_varlen_k_contiguous_p_f16(const NativeVarlenK& g);
void native_varlen_k_gathered_p_f16(const NativeVarlenK& g);
void native_varlen_k_gathered_p_tma_q_f16(const NativeVarlenK& g);
void native_varlen_k_gathered_p_tma_q_transposed_f16(const NativeVarlenK& g);
void native_activation_glu_w1_concat_f16(const NativeVarlenM& g, Activation act, const __nv_bfloat16* bias,
                                         __nv_bfloat16* z, __nv_bfloat16* a_out, W1BiasStrides bias_strides);
void native_store_contiguous_bkn_w1_concat_f16(const NativeVarlenM& g, __nv_bfloat16* c);
void native_varlen_k_contiguous_p_w1_concat_f16(const NativeVarlenK& g);
void native_varlen_k_gathered_p_tma_q_transposed_w1_concat_f16(const NativeVarlenK& g);
void native_varlen_k_contiguous_p_accum_f16(const NativeVarlenK& g);
void native_varlen_k_gathered_p_accum_f16(const NativeVarlenK& g);
void native_varlen_k_gathered_p_tma_q_accum_f16(const NativeVarlenK& g);
void native_varlen_k_gathered_p_tma_q_transposed_accum_f16(const NativeVarlenK& g);
void native_varlen_k_contiguous_p_w1_concat_accum_f16(const NativeVarlenK& g);
void native_varlen_k_gathered_p_tma_q_transposed_w1_concat_accum_f16(const NativeVarlenK& g);
void native_varlen_k_gathered_p_tma_q_accum_tma_f16(const NativeVarlenK& g);
void native_varlen_k_gathered_p_tma_q_transposed_accum_tma_f16(const NativeVarlenK& g);

}  // namespace sonicmoe::cuda::gemm::detail
