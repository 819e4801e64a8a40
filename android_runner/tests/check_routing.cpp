// check_routing: the runner's expert selection (routing.cpp) on logits from a file, for the tests
// against toolkit.models.families.select_experts.
//   check_routing E K SCORE_FUNC N_GROUP TOPK_GROUP GROUP_SCORE SCORE_BIAS TOPK_BEFORE_SOFTMAX NORM SCALE N
//                 LOGITS.bin BIAS.bin OUT.bin
// LOGITS.bin: N x E float32; BIAS.bin: E float32; OUT.bin: per row K int32 ids then K float32 weights.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <vector>

#include "routing.h"

int main(int argc, char** argv) {
  if (argc != 15) {
    std::fprintf(stderr, "usage: check_routing E K SCORE_FUNC N_GROUP TOPK_GROUP GROUP_SCORE SCORE_BIAS "
                         "TOPK_BEFORE_SOFTMAX NORM SCALE N LOGITS.bin BIAS.bin OUT.bin\n");
    return 64;
  }
  spx::RoutingSpec r;
  r.num_experts = std::atoi(argv[1]);
  r.top_k = std::atoi(argv[2]);
  r.score_func = argv[3];
  r.n_group = std::atoi(argv[4]);
  r.topk_group = std::atoi(argv[5]);
  r.group_score = argv[6];
  r.score_bias = std::atoi(argv[7]) != 0;
  r.topk_before_softmax = std::atoi(argv[8]) != 0;
  r.norm_topk_prob = std::atoi(argv[9]) != 0;
  r.routed_scaling_factor = static_cast<float>(std::atof(argv[10]));
  const int n = std::atoi(argv[11]), e = r.num_experts;
  std::vector<float> logits(static_cast<size_t>(n) * e), bias(e);
  std::ifstream(argv[12], std::ios::binary).read(reinterpret_cast<char*>(logits.data()), logits.size() * 4);
  std::ifstream(argv[13], std::ios::binary).read(reinterpret_cast<char*>(bias.data()), bias.size() * 4);
  std::ofstream out(argv[14], std::ios::binary);
  std::vector<int> ids;
  std::vector<float> w;
  for (int i = 0; i < n; ++i) {
    spx::select_experts(logits.data() + static_cast<size_t>(i) * e, r, bias.data(), ids, w);
    for (int id : ids) out.write(reinterpret_cast<const char*>(&id), 4);
    out.write(reinterpret_cast<const char*>(w.data()), w.size() * 4);
  }
  return 0;
}
