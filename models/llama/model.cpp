#include "models/llama/model.h"

namespace ctitan::llama {

DecoderArgs decoder_args(const TransformerModelArgs& a, const std::string& family) {
  DecoderArgs d = a;  // the decoder's part of the args
  d.family = family;
  return d;
}

TransformerBlockImpl::TransformerBlockImpl(int64_t layer_id, const TransformerModelArgs& args)
    : TransformerBlockImpl(layer_id, decoder_args(args), ffn_hidden_dim(args)) {}

TransformerBlockImpl::TransformerBlockImpl(int64_t layer_id, const DecoderArgs& d, int64_t hidden)
    : DecoderBlockImpl(layer_id, d, "feed_forward", FeedForward(d.dim, hidden).ptr()) {
  feed_forward = FeedForward(std::static_pointer_cast<FeedForwardImpl>(ffn_module()));
}

std::optional<TPPlan> TransformerBlockImpl::ffn_tp_plan(const std::string& ff) {
  return TPPlan{
      {ff, TPStyle::GatherInput, &feed_forward->tp_hooks, {}},
      {ff + ".w1", TPStyle::Colwise, &feed_forward->w1->tp_hooks, {ff + ".w1.weight"}},
      {ff + ".w2", TPStyle::Rowwise, &feed_forward->w2->tp_hooks, {ff + ".w2.weight"}},
      {ff + ".w3", TPStyle::Colwise, &feed_forward->w3->tp_hooks, {ff + ".w3.weight"}},
  };
}

namespace {
// Validated before anything is allocated (the base class is built first).
const TransformerModelArgs& validated(const TransformerModelArgs& a, const std::string& family) {
  validate(a, family);
  return a;
}
}  // namespace

TransformerImpl::TransformerImpl(const TransformerModelArgs& args, const std::string& family)
    : DecoderImpl(decoder_args(validated(args, family), family),
                  [&args](int64_t i) {
                    return std::make_shared<TransformerBlockImpl>(i, decoder_args(args), ffn_hidden_dim(args));
                  }),
      args_(args) {}

TransformerBlock TransformerImpl::block(int64_t i) const {
  return TransformerBlock(std::static_pointer_cast<TransformerBlockImpl>(decoder_block(static_cast<size_t>(i))));
}

}  // namespace ctitan::llama
