// Channel wiring checks and routing tables.
#include "fuser/channel_routing.h"

#include <c10/util/Exception.h>

#include <map>

namespace fusible::fuser {
namespace {

std::string describe(const std::vector<std::shared_ptr<ops::BasicOperation>>& ops, int64_t i) {
  return ops[i]->type_name() + " (op " + std::to_string(i) + ")";
}

}  // namespace

void check_channel_wiring(const std::vector<std::shared_ptr<ops::BasicOperation>>& ops,
                          const std::set<std::string>& external) {
  std::map<std::string, std::pair<int64_t, int64_t>> producers;
  for (int64_t i = 0; i < static_cast<int64_t>(ops.size()); ++i) {
    const auto& outs = ops[i]->extra_output_channels();
    for (int64_t s = 0; s < static_cast<int64_t>(outs.size()); ++s) {
      if (!outs[s].name) continue;
      const auto [it, fresh] = producers.emplace(*outs[s].name, std::make_pair(i, s));
      TORCH_CHECK_VALUE(fresh, "channel '", *outs[s].name,
                        "' has multiple producers: ", describe(ops, it->second.first), " output ",
                        it->second.second, " and ", describe(ops, i), " output ", s);
    }
  }
  for (int64_t i = 0; i < static_cast<int64_t>(ops.size()); ++i) {
    const auto& ins = ops[i]->extra_input_channels();
    for (int64_t s = 0; s < static_cast<int64_t>(ins.size()); ++s) {
      if (!ins[s]) continue;
      const auto it = producers.find(*ins[s]);
      if (it == producers.end()) {
        TORCH_CHECK_VALUE(external.count(*ins[s]) > 0, "channel '", *ins[s], "' consumed by ",
                          describe(ops, i), " input ", s,
                          " has no producer (and no named input was supplied for it)");
        continue;
      }
      TORCH_CHECK_VALUE(it->second.first < i, "channel '", *ins[s], "' consumed by ",
                        describe(ops, i), " input ", s, " has no earlier producer (it is made by ",
                        describe(ops, it->second.first), ")");
    }
  }
}

std::shared_ptr<const Routing> build_routing(
    const std::vector<std::shared_ptr<ops::BasicOperation>>& ops,
    const std::set<std::string>& external_inputs, const std::set<std::string>& export_channels) {
  check_channel_wiring(ops, external_inputs);
  auto r = std::make_shared<Routing>();
  const auto n = static_cast<int64_t>(ops.size());
  std::map<std::string, std::pair<int64_t, int64_t>> producers;
  std::map<std::string, int64_t> external_pos;
  r->outputs.resize(n);
  r->inputs.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    for (const auto& ch : ops[i]->extra_output_channels()) {
      OutputSink sink;
      sink.is_public = !ch.name || ch.to_caller;
      sink.name = ch.name.value_or("");
      if (ch.name) producers.emplace(*ch.name, std::make_pair(i, r->outputs[i].size()));
      r->outputs[i].push_back(std::move(sink));
    }
    for (int64_t s = 0; s < ops[i]->num_extra_inputs(); ++s) {
      const auto& ch = ops[i]->extra_input_channels()[s];
      InputSource src;
      if (!ch) {
        src.kind = InputSource::Kind::kPublic;
        src.index = r->num_public_inputs++;
      } else if (const auto it = producers.find(*ch); it != producers.end()) {
        src.kind = InputSource::Kind::kInternal;
        src.op = it->second.first;
        src.slot = it->second.second;
        r->outputs[src.op][src.slot].consumers.emplace_back(i, s);
      } else {
        src.kind = InputSource::Kind::kExternal;
        const auto [it2, fresh] =
            external_pos.emplace(*ch, static_cast<int64_t>(r->external_inputs.size()));
        if (fresh) r->external_inputs.push_back(*ch);
        src.index = it2->second;
      }
      r->inputs[i].push_back(src);
    }
  }
  for (auto& sinks : r->outputs) {
    for (auto& sink : sinks) {
      if (sink.is_public || (!sink.name.empty() && export_channels.count(sink.name) > 0)) {
        sink.position = static_cast<int64_t>(r->exported.size());
        r->exported.push_back({sink.is_public, sink.name});
      }
    }
  }
  return r;
}

std::vector<GroupChannels> plan_group_channels(
    const std::vector<std::vector<std::shared_ptr<ops::BasicOperation>>>& groups,
    const std::set<std::string>& named_inputs) {
  std::vector<std::shared_ptr<ops::BasicOperation>> all;
  std::vector<size_t> group_of;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const auto& op : groups[g]) {
      all.push_back(op);
      group_of.push_back(g);
    }
  }
  check_channel_wiring(all, named_inputs);
  std::map<std::string, size_t> producer_group;
  for (size_t i = 0; i < all.size(); ++i) {
    for (const auto& ch : all[i]->extra_output_channels()) {
      if (ch.name) producer_group[*ch.name] = group_of[i];
    }
  }
  std::vector<GroupChannels> out(groups.size());
  for (size_t i = 0; i < all.size(); ++i) {
    for (const auto& ch : all[i]->extra_input_channels()) {
      if (!ch) continue;
      const auto it = producer_group.find(*ch);
      if (it == producer_group.end()) {
        out[group_of[i]].external_inputs.insert(*ch);  // fed by the caller by name
        out[group_of[i]].caller_inputs.insert(*ch);
      } else if (it->second != group_of[i]) {
        out[group_of[i]].external_inputs.insert(*ch);  // made by an earlier group
        out[it->second].export_channels.insert(*ch);
      }
    }
  }
  return out;
}

}  // namespace fusible::fuser
