//! The run's progress on stderr: one bar per layer (its ops, the op running now), and when a layer
//! is done its line stays with the prompt's tokens per second through it, so a long prompt shows
//! how fast each layer goes. Hidden when stderr is not a terminal (indicatif's stderr target) or
//! when the run asks for no progress.

use std::time::Instant;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::model::graph::Op;

/// Where a run is, drawn as one bar per layer.
pub struct Progress {
    multi: MultiProgress,
    /// Runs of ops of one layer, in graph order (`None`: the embedding, the head's ops).
    ops_of: Vec<(Option<usize>, u64)>,
    /// The next run of `ops_of` to open.
    next: usize,
    tokens: usize,
    /// The layer (or the ops outside layers) being run: its bar and when it began.
    current: Option<(Option<usize>, ProgressBar, Instant)>,
}

impl Progress {
    /// Bars for `ops` over a prompt of `tokens`; drawn only when `shown` and stderr is a terminal.
    pub fn new(ops: &[Op], tokens: usize, shown: bool) -> Progress {
        let target = if shown {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let mut ops_of: Vec<(Option<usize>, u64)> = Vec::new();
        for op in ops {
            match ops_of.last_mut() {
                Some((l, n)) if *l == op.layer => *n += 1,
                _ => ops_of.push((op.layer, 1)),
            }
        }
        Progress {
            multi: MultiProgress::with_draw_target(target),
            ops_of,
            next: 0,
            tokens,
            current: None,
        }
    }

    /// Op `op` begins: a new bar when it opens a layer.
    pub fn start(&mut self, op: &Op) {
        if self.current.as_ref().is_none_or(|c| c.0 != op.layer) {
            self.end_layer();
            let len = match self.ops_of.get(self.next) {
                Some(&(l, n)) if l == op.layer => n,
                _ => 1,
            };
            self.next += 1;
            let bar = self.multi.add(ProgressBar::new(len));
            bar.set_style(
                ProgressStyle::with_template("{prefix:>6} {wide_bar} {pos}/{len} ops {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar.set_prefix(op.layer.map_or("model".to_string(), |l| format!("L{l}")));
            self.current = Some((op.layer, bar, Instant::now()));
        }
        if let Some((_, bar, _)) = &self.current {
            bar.set_message(op.id.clone());
        }
    }

    /// The op begun last is done.
    pub fn done(&mut self) {
        if let Some((_, bar, _)) = &self.current {
            bar.inc(1);
        }
    }

    /// The run is over (or stopped): every layer's line stays on the terminal.
    pub fn finish(&mut self) {
        self.end_layer();
    }

    fn end_layer(&mut self) {
        if let Some((layer, bar, t0)) = self.current.take() {
            match layer {
                Some(_) => {
                    bar.finish_with_message(rate_line(self.tokens, t0.elapsed().as_secs_f64()))
                }
                None => bar.finish_and_clear(),
            }
        }
    }
}

/// A finished layer's line: the prompt's tokens, the seconds the layer took, tokens per second.
pub fn rate_line(tokens: usize, secs: f64) -> String {
    let rate = if secs > 0.0 {
        tokens as f64 / secs
    } else {
        f64::INFINITY
    };
    let rate = if rate >= 1e4 && rate.is_finite() {
        format!("{:.1}k", rate / 1e3)
    } else {
        format!("{rate:.0}")
    };
    format!("{tokens} tokens in {secs:.2} s, {rate} tokens/s")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_line_says_tokens_seconds_and_rate() {
        assert_eq!(rate_line(4096, 2.0), "4096 tokens in 2.00 s, 2048 tokens/s");
        assert_eq!(
            rate_line(131072, 4.0),
            "131072 tokens in 4.00 s, 32.8k tokens/s"
        );
        assert!(rate_line(8, 0.0).ends_with("inf tokens/s"));
    }

    #[test]
    fn bars_follow_the_layers_of_the_graph() {
        let ck = crate::synth::builtin(0).expect("built-in model");
        let cfg = ck.model_config().expect("config").clone();
        let last = cfg.num_hidden_layers - 1;
        let ops = crate::model::graph::build_graph(&cfg, last, true);
        let mut p = Progress::new(&ops, 16, false);
        // embed (outside layers), each layer's ops, then the head's: one run each, in order
        let layers: Vec<Option<usize>> = p.ops_of.iter().map(|x| x.0).collect();
        let mut want = vec![None];
        want.extend((0..=last).map(Some));
        want.push(None);
        assert_eq!(layers, want);
        let total: u64 = p.ops_of.iter().map(|x| x.1).sum();
        assert_eq!(total, ops.len() as u64);
        let mut opened = Vec::new();
        let mut want_len = 0u64;
        for (i, op) in ops.iter().enumerate() {
            p.start(op);
            let (l, bar, _) = p.current.as_ref().expect("a bar");
            if opened.len() != p.next {
                opened.push(*l);
                // the run it opens: the consecutive ops of this layer from here
                want_len = ops[i..].iter().take_while(|o| o.layer == *l).count() as u64;
            }
            assert_eq!(bar.length(), Some(want_len), "{}", op.id);
            p.done();
        }
        assert_eq!(opened, layers);
        // the head's run: hc_head, final norm, head
        assert_eq!(p.ops_of.last().map(|x| x.1), Some(3));
        p.finish();
        assert!(p.current.is_none());
    }
}
