// `pipesgd report RUN...`: runs side by side, for the question a user measures runs to answer
// ("how much sooner does this reach the accuracy?"). A RUN is a `--out` directory (metrics.jsonl,
// and summary.json when the run finished) or a metrics.jsonl file of the same lines (the PyTorch
// DDP runs of bench/ write those). Prints one markdown table: mode, pipeline width, codec,
// transport, launcher, samples/s, training time to each target accuracy, final accuracy and the
// speedup over the first run to the first target; draws test accuracy against training time
// (evaluations left out, as metrics.jsonl's wall_s) with gnuplot into a PNG.
#pragma once

#include <string>
#include <vector>

namespace pipesgd::launcher {

struct ReportArgs {
  std::vector<std::string> runs;
  // Test accuracies to report the time to; empty: the runs' train.target_accuracy values, else 0.85.
  std::vector<double> targets;
  std::string png = "report.png";  // empty: no plot
};

// Throws Error naming the run and the line: kNotFound (no metrics.jsonl), kDataLoss (a line that
// is not a metrics object; a field of metrics.jsonl or summary.json that is missing where
// needed, of the wrong type (null included) or out of range: the message names the file, the
// field, the value and what was expected), kUnavailable (gnuplot missing or failing, after the
// table printed).
void RunReport(const ReportArgs& args);

}  // namespace pipesgd::launcher
