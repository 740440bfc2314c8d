//! Per routed expert: each expert's own served output on the rows routed to it against the BF16
//! oracle's (both fed the BF16 oracle's inputs, unweighted: `model::exec::experts_by_expert`),
//! held to a tolerance from its own row count. A whole-op rel-L2 averages one broken expert with
//! dozens of healthy ones ("not all experts calibrated"); this names it.

use serde::Serialize;

use super::env::{PathEnv, Shared};
use crate::model::exec::experts_by_expert;
use crate::model::graph::{Op, OpKind};
use crate::served::PathKind;
use crate::{Result, Tensor};

/// Which experts are measured one by one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ExpertMetrics {
    /// Only the whole op.
    Off,
    /// Every expert a token reached, on its routed rows (the default).
    #[default]
    Routed,
    /// Also every expert no token reached, on the prompt's first rows (`--exercise-experts`).
    Exercise,
}

/// One expert's sums over its rows (a run in token chunks adds each chunk's rows in turn).
#[derive(Clone, Debug, Default)]
pub struct ExpertSums {
    /// Rows routed to it, and rows given to it only to exercise it.
    pub rows: usize,
    pub exercised_rows: usize,
    dot: f64,
    nx: f64,
    nr: f64,
    ne: f64,
    non_finite: usize,
    /// Rows of its served output that are all zero where the oracle's are not.
    zero_rows: usize,
}

/// Every expert's sums of one routed-experts op.
#[derive(Clone, Debug, Default)]
pub struct PerExpert {
    pub sums: Vec<ExpertSums>,
}

impl PerExpert {
    /// Adds one execution's rows: served and oracle outputs [s, d], each row's expert, and how
    /// many leading rows were routed (the rest exercise unreached experts).
    pub fn add(
        &mut self,
        served: &Tensor,
        oracle: &Tensor,
        owner: &[usize],
        routed: usize,
        e: usize,
    ) {
        if self.sums.len() < e {
            self.sums.resize(e, ExpertSums::default());
        }
        let d = served.cols().max(1);
        let (sv, or) = (&served.data[..], &oracle.data[..]);
        for (s, &ex) in owner.iter().enumerate() {
            let a = &mut self.sums[ex];
            if s < routed {
                a.rows += 1;
            } else {
                a.exercised_rows += 1;
            }
            let (x, r) = (&sv[s * d..(s + 1) * d], &or[s * d..(s + 1) * d]);
            let (mut zx, mut zr) = (true, true);
            for (&p, &q) in x.iter().zip(r) {
                if !p.is_finite() {
                    if q.is_finite() {
                        a.non_finite += 1;
                    }
                    continue;
                }
                if !q.is_finite() {
                    continue;
                }
                zx &= p == 0.0;
                zr &= q == 0.0;
                let (p, q) = (p as f64, q as f64);
                a.dot += p * q;
                a.nx += p * p;
                a.nr += q * q;
                a.ne += (p - q) * (p - q);
            }
            if zx && !zr {
                a.zero_rows += 1;
            }
        }
    }

    /// The experts' records under the op's tolerance `tol` (see [`expert_tolerance`]).
    pub fn records(&self, tol: f64) -> Vec<ExpertRecord> {
        self.sums
            .iter()
            .enumerate()
            .filter(|(_, s)| s.rows + s.exercised_rows > 0)
            .map(|(i, s)| {
                let n = s.rows + s.exercised_rows;
                let rel_l2 = (s.nr > 0.0).then(|| (s.ne / s.nr).sqrt());
                let cos = (s.nx > 0.0 && s.nr > 0.0).then(|| s.dot / (s.nx * s.nr).sqrt());
                let tolerance = expert_tolerance(tol, n);
                let reason = if s.non_finite > 0 {
                    Some(format!(
                        "{} NaN/Inf where the oracle has none",
                        s.non_finite
                    ))
                } else if s.zero_rows == n && s.nr > 0.0 {
                    Some("its output is zero on every row where the oracle's is not".to_string())
                } else {
                    rel_l2.filter(|r| *r > tolerance).map(|r| {
                        format!(
                            "isolated rel-L2 {r:.3e} > its tolerance {tolerance:.3e} ({n} rows)"
                        )
                    })
                };
                ExpertRecord {
                    expert: i,
                    rows: s.rows,
                    exercised_rows: s.exercised_rows,
                    rel_l2,
                    cos,
                    tolerance,
                    divergent: reason.is_some(),
                    reason,
                }
            })
            .collect()
    }

    /// Experts no token reached (in `e` experts).
    pub fn unreached(&self, e: usize) -> Vec<usize> {
        (0..e)
            .filter(|&i| self.sums.get(i).is_none_or(|s| s.rows == 0))
            .collect()
    }
}

/// An expert's rel-L2 tolerance on n rows: the op's (the healthy error of its class, format and
/// profile), widened by 1/√n for the few-row estimate, and never beyond
/// [`super::consequence::HARMFUL_REL_L2`] (an output that far off is not a perturbation).
pub fn expert_tolerance(op_tol: f64, n: usize) -> f64 {
    (op_tol * (1.0 + 1.0 / (n.max(1) as f64).sqrt())).min(super::consequence::HARMFUL_REL_L2)
}

/// One expert of a routed-experts op in the run JSON (`experts` of the op record).
#[derive(Clone, Debug, Serialize)]
pub struct ExpertRecord {
    pub expert: usize,
    /// Rows routed to it.
    pub rows: usize,
    /// Rows given to it by `--exercise-experts` (none routed).
    pub exercised_rows: usize,
    /// Served vs BF16 oracle on its rows (both on the oracle's inputs, unweighted).
    pub rel_l2: Option<f64>,
    pub cos: Option<f64>,
    pub tolerance: f64,
    pub divergent: bool,
    pub reason: Option<String>,
}

/// One execution's rows of every expert (see [`measure`]): served and oracle outputs [s, d],
/// each row's expert, how many leading rows were routed, and the layer's expert count.
pub struct ExpertRows {
    pub served: Tensor,
    pub oracle: Tensor,
    pub owner: Vec<usize>,
    pub routed: usize,
    pub experts: usize,
}

impl PerExpert {
    /// Adds one execution's rows (a run in token chunks adds each chunk's in turn: the sums
    /// then see the rows in the whole prompt's order, so they are the same bits).
    pub fn add_rows(&mut self, r: &ExpertRows) {
        self.add(&r.served, &r.oracle, &r.owner, r.routed, r.experts);
    }
}

/// Each expert of routed-experts op `op` on the BF16 oracle's inputs `bf_inputs`, served and
/// oracle (None for other ops or with [`ExpertMetrics::Off`]).
pub(crate) fn measure(
    shared: &mut Shared,
    op: &Op,
    bf_inputs: &[&Tensor],
    mode: ExpertMetrics,
) -> Result<Option<ExpertRows>> {
    if !matches!(op.kind, OpKind::Experts | OpKind::GptOssExperts) || mode == ExpertMetrics::Off {
        return Ok(None);
    }
    let exercise = mode == ExpertMetrics::Exercise;
    let run = |kind: PathKind, shared: &mut Shared| {
        shared.carry_slot = 5;
        let mut env = PathEnv { kind, shared };
        experts_by_expert(op, bf_inputs, &mut env, exercise)
    };
    let (served, owner, _) = run(PathKind::Served, shared)?;
    let (oracle, _, _) = run(PathKind::OracleBf16, shared)?;
    Ok(Some(ExpertRows {
        served,
        oracle,
        owner,
        routed: bf_inputs[2].numel(),
        experts: shared.cfg.n_routed_experts,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zeroed_expert_diverges_and_a_healthy_one_does_not() {
        let d = 16;
        let oracle: Vec<f32> = (0..4 * d).map(|i| ((i as f32) * 0.37).sin()).collect();
        let mut served = oracle.clone();
        // rows 0, 1: expert 2 (healthy, 5 % noise); rows 2, 3: expert 5 (zeroed)
        for v in served[..2 * d].iter_mut() {
            *v *= 1.05;
        }
        for v in served[2 * d..].iter_mut() {
            *v = 0.0;
        }
        let mut p = PerExpert::default();
        let (s, o) = (
            Tensor::new(vec![4, d], served),
            Tensor::new(vec![4, d], oracle),
        );
        p.add(&s, &o, &[2, 2, 5, 5], 4, 8);
        let r = p.records(0.2);
        assert_eq!(r.iter().map(|x| x.expert).collect::<Vec<_>>(), vec![2, 5]);
        assert!(!r[0].divergent && (r[0].rel_l2.unwrap() - 0.05).abs() < 1e-6);
        assert!(r[1].divergent && r[1].reason.as_deref().unwrap().contains("zero"));
        assert_eq!(p.unreached(8), vec![0, 1, 3, 4, 6, 7]);
        // the two halves added in turn (as a run in token chunks does) equal the whole
        let mut a = PerExpert::default();
        a.add(
            &Tensor::new(vec![2, d], s.data[..2 * d].to_vec()),
            &Tensor::new(vec![2, d], o.data[..2 * d].to_vec()),
            &[2, 2],
            2,
            8,
        );
        a.add(
            &Tensor::new(vec![2, d], s.data[2 * d..].to_vec()),
            &Tensor::new(vec![2, d], o.data[2 * d..].to_vec()),
            &[5, 5],
            2,
            8,
        );
        assert_eq!(format!("{:?}", a.records(0.2)), format!("{:?}", r));
    }

    #[test]
    fn tolerance_widens_with_few_rows_and_stops_below_harmful() {
        assert!((expert_tolerance(0.2, 100) - 0.22).abs() < 1e-12);
        assert!((expert_tolerance(0.2, 1) - 0.4).abs() < 1e-12);
        assert_eq!(expert_tolerance(0.8, 1), 0.9);
    }
}
