// Channel routing of a fuser: where each extra input comes from (the caller, an earlier op, or a
// named tensor from outside) and where each extra output goes, checked once at construction.
#pragma once

#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ops/fusible_operation.h"

namespace fusible::fuser {

struct InputSource {
  enum class Kind { kPublic, kInternal, kExternal };
  Kind kind = Kind::kPublic;
  int64_t index = -1;  // public position, or external position
  int64_t op = -1;     // producer basic op (internal)
  int64_t slot = -1;   // producer output slot (internal)
};

struct OutputSink {
  int64_t position = -1;  // position among the fuser's exported outputs, -1 when not exported
  bool is_public = true;  // returned to the caller
  std::string name;       // channel name, empty when unnamed
  std::vector<std::pair<int64_t, int64_t>> consumers;  // (basic op, input slot) inside the fuser
};

/// An exported output: public ones go back to the caller, named hidden ones feed other groups.
struct ExportedOutput {
  bool is_public = true;
  std::string name;
};

struct Routing {
  std::vector<std::vector<InputSource>> inputs;  // per basic op, per extra-input slot
  std::vector<std::vector<OutputSink>> outputs;  // per basic op, per extra-output slot
  int64_t num_public_inputs = 0;
  std::vector<std::string> external_inputs;  // by external position
  std::vector<ExportedOutput> exported;      // by exported position
};

/// Checks channel wiring over basic ops in forward order; `external` names channels fed from
/// outside. Throws ValueError naming the channel and the ops ("multiple producers", "has no
/// producer", "has no earlier producer").
void check_channel_wiring(const std::vector<std::shared_ptr<ops::BasicOperation>>& ops,
                          const std::set<std::string>& external);

/// Checks the wiring, then builds the routing. Hidden named outputs listed in `export_channels`
/// are exported too (a later fuser group consumes them).
std::shared_ptr<const Routing> build_routing(
    const std::vector<std::shared_ptr<ops::BasicOperation>>& ops,
    const std::set<std::string>& external_inputs, const std::set<std::string>& export_channels);

/// Channels one fuser group takes from outside and hands on (see FuserOptions).
struct GroupChannels {
  std::set<std::string> external_inputs;  // from the caller or from an earlier group
  std::set<std::string> caller_inputs;    // those the caller feeds by name (no producer here)
  std::set<std::string> export_channels;
};

/// For consecutive fuser groups of one model (a Sequential): checks the wiring across all of them
/// (`named_inputs` are channels the caller feeds by name) and returns each group's channels.
std::vector<GroupChannels> plan_group_channels(
    const std::vector<std::vector<std::shared_ptr<ops::BasicOperation>>>& groups,
    const std::set<std::string>& named_inputs);

}  // namespace fusible::fuser
