// The CUTLASS ptr-array grouped GEMM (TMA + wgmma, persistent, warp-specialised) with per-group problem
// shapes, pointers and strides written by a small device kernel from `offsets`: no host-known group sizes.
// Included only by the instantiation .cu files (one or two kernels each).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <string>

#include "core/cuda_check.h"
#include "baselines/grouped_gemm_cutlass.h"
#include "cuda/gemm/tma_encode.h"

namespace sonicmoe::baselines::detail {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;

// CTAs per cluster along M (B tiles multicast by TMA to the CTAs of a cluster). Build-time knob for tuning.
#ifndef SONICMOE_GEMM_CLUSTER_M
#define SONICMOE_GEMM_CLUSTER_M 1
#endif
using ClusterM = cute::Shape<cute::Int<SONICMOE_GEMM_CLUSTER_M>, cute::_1, cute::_1>;

// A grouped GEMM type from operand layouts, schedules and tile.
template <class LayoutA, class LayoutB, class KernelSchedule, class EpilogueSchedule, class TileShape,
          class ClusterShape>
struct GroupedGemmSm90 {
  using Element = cutlass::bfloat16_t;
  static constexpr int kAlign = 8;  // 16 bytes of bf16
  using LayoutD = cutlass::layout::RowMajor;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, LayoutD*, kAlign, Element, LayoutD*,
      kAlign, EpilogueSchedule, cutlass::epilogue::fusion::LinearCombination<Element, float>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlign, Element, LayoutB*, kAlign,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;

  // Per-group arrays at the head of the workspace; CUTLASS's own workspace follows.
  struct Arrays {
    Shape3* shapes;
    const Element** ptr_a;
    const Element** ptr_b;
    const Element** ptr_c;
    Element** ptr_d;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideC* stride_c;
    StrideD* stride_d;
  };

  static std::size_t round_up(std::size_t x) { return (x + 255) / 256 * 256; }

  static std::size_t arrays_bytes(int g) {
    return round_up(sizeof(Shape3) * g) + 4 * round_up(sizeof(void*) * g) + round_up(sizeof(StrideA) * g) +
           round_up(sizeof(StrideB) * g) + round_up(sizeof(StrideC) * g) + round_up(sizeof(StrideD) * g);
  }

  static Arrays carve(void* ws, int g) {
    char* p = static_cast<char*>(ws);
    Arrays a;
    auto take = [&](std::size_t bytes) {
      char* q = p;
      p += round_up(bytes);
      return q;
    };
    a.shapes = reinterpret_cast<Shape3*>(take(sizeof(Shape3) * g));
    a.ptr_a = reinterpret_cast<const Element**>(take(sizeof(void*) * g));
    a.ptr_b = reinterpret_cast<const Element**>(take(sizeof(void*) * g));
    a.ptr_c = reinterpret_cast<const Element**>(take(sizeof(void*) * g));
    a.ptr_d = reinterpret_cast<Element**>(take(sizeof(void*) * g));
    a.stride_a = reinterpret_cast<StrideA*>(take(sizeof(StrideA) * g));
    a.stride_b = reinterpret_cast<StrideB*>(take(sizeof(StrideB) * g));
    a.stride_c = reinterpret_cast<StrideC*>(take(sizeof(StrideC) * g));
    a.stride_d = reinterpret_cast<StrideD*>(take(sizeof(StrideD) * g));
    return a;
  }

  static typename Gemm::Arguments arguments(const Arrays& a, int groups, int sm_count) {
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = sm_count;
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                  {groups, a.shapes, nullptr},
                                  {a.ptr_a, a.stride_a, a.ptr_b, a.stride_b},
                                  {{}, a.ptr_c, a.stride_c, a.ptr_d, a.stride_d},
                                  hw};
    auto& f = args.epilogue.thread;
    f.alpha = 1.0f;
    f.beta = 0.0f;  // C is never read: plain store (bias / scale come in the epilogue pass)
    f.alpha_ptr = nullptr;
    f.beta_ptr = nullptr;
    f.alpha_ptr_array = nullptr;
    f.beta_ptr_array = nullptr;
    f.dAlpha = {cute::_0{}, cute::_0{}, 0};
    f.dBeta = {cute::_0{}, cute::_0{}, 0};
    return args;
  }

  static std::size_t workspace_bytes(int groups, int sm_count) {
    Arrays dummy{};
    typename Gemm::Arguments args = arguments(dummy, groups, sm_count);
    return arrays_bytes(groups) + round_up(Gemm::get_workspace_size(args));
  }

  // Fill the arrays (already done on the device by the caller's setup kernel), then run.
  static void run(const Arrays& a, int groups, void* ws, int sm_count, cudaStream_t stream) {
    typename Gemm::Arguments args = arguments(a, groups, sm_count);
    Gemm gemm;
    cutlass::Status st = gemm.can_implement(args);
    if (st != cutlass::Status::kSuccess)
      throw Error(std::string("sonicmoe grouped GEMM: CUTLASS cannot implement this problem: ") +
                  cutlassGetStatusString(st));
    void* cutlass_ws = static_cast<char*>(ws) + arrays_bytes(groups);
    st = gemm.initialize(args, cutlass_ws, stream);
    cuda::tma::check_encoded("the CUTLASS ptr-array grouped GEMM's operands");
    if (st != cutlass::Status::kSuccess)
      throw Error(std::string("sonicmoe grouped GEMM: initialize failed: ") + cutlassGetStatusString(st));
    st = gemm.run(stream);
    if (st != cutlass::Status::kSuccess)
      throw Error(std::string("sonicmoe grouped GEMM: launch failed: ") + cutlassGetStatusString(st));
    SONICMOE_CUDA_CHECK_LAUNCH();
  }
};

// The two kernel flavours the baselines instantiate, by operand layouts: cooperative (128x256 tile, two consumer
// warpgroups share a tile) and ping-pong (128x128 tile per consumer warpgroup, one warpgroup's epilogue under the
// other's MMA).
template <class LayoutA, class LayoutB>
using CooperativeGemm = GroupedGemmSm90<LayoutA, LayoutB, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                                        cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
                                        cute::Shape<cute::_128, cute::_256, cute::_64>, ClusterM>;
template <class LayoutA, class LayoutB>
using PingpongGemm = GroupedGemmSm90<LayoutA, LayoutB, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                     cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                     cute::Shape<cute::_128, cute::_128, cute::_64>, ClusterM>;

}  // namespace sonicmoe::baselines::detail
