//! The session driven through whole loops, as the front ends drive it: every
//! signal position, every loop shape, resumed from what the interruption
//! left; and replay plans executed. A simulated program's state is the list
//! of training steps it has run; a checkpoint copies it.

use std::collections::BTreeMap;

use super::record::{Status, MIN_KEPT_IN_BUDGET};
use super::*;
use crate::checkpoint::naming::CheckpointId;
use crate::checkpoint::retention::Retention;
use crate::runs::replay::{Mode, WorkerPlan};
use crate::runs::schedule::CheckpointSchedule;

type State = Vec<(u64, u64)>;

/// Where a stop signal arrives.
#[derive(Clone, Copy, Debug)]
enum At {
    /// Before iteration `i` starts (it lands at its first boundary).
    Iteration(u64),
    /// During step `j` of iteration `i`.
    Step(u64, u64),
    /// After the steps of iteration `i`, before it ends (evaluation).
    AfterSteps(u64),
}

#[derive(Clone, Copy)]
struct Shape {
    outer: u64,
    /// None: the iteration has no inner loop (its body is one step).
    steps: Option<u64>,
    every: Option<u64>,
}

struct Outcome {
    state: State,
    saved: BTreeMap<String, State>,
    exit: Option<i32>,
    /// Steps run by this process, in order (a resume must not repeat any).
    ran: State,
}

fn session(shape: Shape) -> RecordSession {
    // A period longer than the loop never checkpoints a block.
    let every = shape.every.unwrap_or(1_000_000);
    let mut s = RecordSession::new(
        "r1",
        CheckpointSchedule::new(Some(every), 0.1).unwrap(),
        85,
        None,
        0.0,
    );
    s.set_objects(true);
    s
}

fn drive(
    mut s: RecordSession,
    shape: Shape,
    signal: Option<At>,
    mut saved: BTreeMap<String, State>,
) -> Outcome {
    let mut state = State::new();
    let mut ran = State::new();
    s.outer_start("epoch", Some(shape.outer));
    let save = |saved: &mut BTreeMap<String, State>, name: String, state: &State| {
        saved.insert(name, state.clone());
    };
    for i in 0..shape.outer {
        if let Some(At::Iteration(k)) = signal {
            if k == i {
                s.signal(15);
            }
        }
        match s.iteration_start(i) {
            Visit::Skip => continue,
            Visit::Restore { checkpoint } => state = saved[&checkpoint].clone(),
            Visit::Rerun { .. } | Visit::Run => {}
            other => panic!("a recording does not {other:?}"),
        }
        match shape.steps {
            None => {
                // One step per iteration: its end is the block's end.
                state.push((i, 0));
                ran.push((i, 0));
                if let Some(b) = s.block_end(i, 0.0, None, None, 0.0).unwrap() {
                    save(&mut saved, b.name, &state);
                }
            }
            Some(n) => {
                let first = match s.block_start(i) {
                    BlockStart::Run => Some(0),
                    BlockStart::Restore { checkpoint } => {
                        state = saved[&checkpoint].clone();
                        None
                    }
                    BlockStart::ResumeSteps { checkpoint, step } => {
                        state = saved[&checkpoint].clone();
                        Some(step)
                    }
                };
                if let Some(first) = first {
                    for j in first..n {
                        if matches!(signal, Some(At::Step(k, l)) if (k, l) == (i, j)) {
                            s.signal(10);
                        }
                        state.push((i, j));
                        ran.push((i, j));
                        let act = s.step_boundary(i, j, 0.0).unwrap();
                        if let Some(name) = act.save {
                            assert!(act.wait == act.exit.is_some());
                            save(&mut saved, name, &state);
                        }
                        if act.exit.is_some() {
                            return Outcome {
                                state,
                                saved,
                                exit: act.exit,
                                ran,
                            };
                        }
                    }
                    if let Some(b) = s.block_end(i, 1.0, None, None, 0.0).unwrap() {
                        save(&mut saved, b.name, &state);
                    }
                }
            }
        }
        if matches!(signal, Some(At::AfterSteps(k)) if k == i) {
            s.signal(15);
        }
        let end = s.iteration_end(i, false).unwrap();
        if let Some(name) = end.save {
            save(&mut saved, name, &state);
        }
        if end.exit.is_some() {
            return Outcome {
                state,
                saved,
                exit: end.exit,
                ran,
            };
        }
    }
    if let Some(name) = s.outer_end().unwrap() {
        state = saved[&name].clone();
    }
    Outcome {
        state,
        saved,
        exit: None,
        ran,
    }
}

/// The newest checkpoint, as the front end finds it (listed = complete).
fn newest(saved: &BTreeMap<String, State>) -> &String {
    saved
        .keys()
        .max_by_key(|n| CheckpointId::parse(n).unwrap().order())
        .unwrap()
}

fn every_signal(shape: Shape) -> Vec<At> {
    let mut at = Vec::new();
    for i in 0..shape.outer {
        at.push(At::Iteration(i));
        for j in 0..shape.steps.unwrap_or(0) {
            at.push(At::Step(i, j));
        }
        at.push(At::AfterSteps(i));
    }
    at
}

#[test]
fn a_signal_at_every_boundary_resumes_to_the_uninterrupted_state_without_repeating_a_step() {
    let shapes = [
        Shape {
            outer: 3,
            steps: Some(3),
            every: Some(1),
        },
        Shape {
            outer: 3,
            steps: Some(3),
            every: Some(2),
        },
        Shape {
            outer: 3,
            steps: Some(2),
            every: None,
        },
        Shape {
            outer: 4,
            steps: None,
            every: Some(1),
        },
        Shape {
            outer: 4,
            steps: None,
            every: None,
        },
    ];
    for shape in shapes {
        let whole = drive(session(shape), shape, None, BTreeMap::new());
        assert_eq!(whole.exit, None);
        for at in every_signal(shape) {
            let first = drive(session(shape), shape, Some(at), BTreeMap::new());
            let case = format!("{:?} at {at:?}", (shape.outer, shape.steps, shape.every));
            assert_eq!(
                first.exit,
                Some(85),
                "{case}: leaves with the checkpoint exit code"
            );
            let mut again = session(shape);
            let name = newest(&first.saved).clone();
            // A block checkpoint of a loop without steps holds the whole iteration.
            again.resume_from(ResumePoint::new(&name, shape.steps.is_none()).unwrap());
            let second = drive(again, shape, None, first.saved.clone());
            assert_eq!(second.exit, None, "{case}");
            assert_eq!(second.state, whole.state, "{case}: resumed from {name}");
            let mut both = first.ran.clone();
            both.extend(&second.ran);
            assert_eq!(
                both, whole.ran,
                "{case}: each step runs once, in order (from {name})"
            );
        }
    }
}

#[test]
fn a_signal_after_the_last_iteration_restores_its_state_for_the_code_after_the_loop() {
    let shape = Shape {
        outer: 2,
        steps: Some(2),
        every: None,
    };
    let first = drive(
        session(shape),
        shape,
        Some(At::AfterSteps(1)),
        BTreeMap::new(),
    );
    let name = newest(&first.saved).clone();
    assert_eq!(name, "r1.epoch-000001.end");
    let mut again = session(shape);
    again.resume_from(ResumePoint::new(&name, false).unwrap());
    let second = drive(again, shape, None, first.saved.clone());
    assert!(second.ran.is_empty());
    assert_eq!(second.state, first.state);
}

#[test]
fn a_resume_whose_loop_got_shorter_is_refused_naming_the_checkpoint() {
    let mut s = session(Shape {
        outer: 2,
        steps: Some(1),
        every: Some(1),
    });
    s.resume_from(ResumePoint::new("r1.epoch-000005", false).unwrap());
    s.outer_start("epoch", Some(2));
    assert_eq!(s.iteration_start(0), Visit::Skip);
    assert_eq!(s.iteration_start(1), Visit::Skip);
    let e = s.outer_end().unwrap_err();
    assert_eq!(e.kind(), crate::error::ErrorKind::Replay);
    assert_eq!(e.run(), Some("r1"));
    let text = e.to_string();
    assert!(
        text.contains("r1.epoch-000005") && text.contains("ends after 2 iterations"),
        "{text}"
    );
}

#[test]
fn without_state_a_signal_exits_at_the_next_boundary_saving_nothing() {
    let mut s = RecordSession::new(
        "r1",
        CheckpointSchedule::new(Some(1), 0.1).unwrap(),
        77,
        None,
        0.0,
    );
    s.outer_start("epoch", Some(2));
    assert_eq!(s.iteration_start(0), Visit::Run);
    assert_eq!(s.block_start(0), BlockStart::Run);
    assert_eq!(s.step_boundary(0, 0, 0.0).unwrap(), StepAction::default());
    s.signal(15);
    s.signal(10); // the first one counts
    assert_eq!(s.pending_signal(), Some(15));
    let act = s.step_boundary(0, 1, 0.0).unwrap();
    assert_eq!((act.save, act.exit, act.prepare), (None, Some(77), false));
}

#[test]
fn an_iteration_whose_start_was_not_kept_takes_no_checkpoint_inside_and_exits_on_a_signal() {
    let mut s = RecordSession::new(
        "r1",
        CheckpointSchedule::new(Some(1), 0.1).unwrap(),
        85,
        Some(60.0),
        0.0,
    );
    s.set_objects(true);
    s.outer_start("it", None);
    // Iteration 1 is the first to run steps; its start was not kept.
    s.iteration_start(1);
    s.start_unkept(1);
    s.block_start(1);
    let due = s.step_boundary(1, 0, 100.0).unwrap();
    assert_eq!((due.save, due.exit), (None, None), "the safety timer waits");
    assert_eq!(
        s.block_end(1, 1.0, None, None, 0.0).unwrap(),
        None,
        "every 1 waits too"
    );
    s.signal(15);
    let act = s.step_boundary(1, 1, 100.0).unwrap();
    assert_eq!((act.save.as_deref(), act.exit), (None, Some(85)), "{act:?}");
    // The next iteration's start is kept again: its block is saved.
    let mut s = RecordSession::new(
        "r1",
        CheckpointSchedule::new(Some(1), 0.1).unwrap(),
        85,
        None,
        0.0,
    );
    s.set_objects(true);
    s.outer_start("it", None);
    s.iteration_start(1);
    s.start_unkept(1);
    s.iteration_end(1, false).unwrap();
    s.iteration_start(2);
    s.block_start(2);
    assert!(s.block_end(2, 1.0, None, None, 0.0).unwrap().is_some());
}

#[test]
fn the_safety_timer_saves_a_step_checkpoint_without_leaving() {
    let mut s = RecordSession::new(
        "r1",
        CheckpointSchedule::new(Some(100), 0.1).unwrap(),
        85,
        Some(60.0),
        0.0,
    );
    s.set_objects(true);
    s.outer_start("it", None);
    s.iteration_start(0);
    s.block_start(0);
    let first = s.step_boundary(0, 0, 10.0).unwrap();
    assert!(first.prepare && first.save.is_none(), "{first:?}");
    let due = s.step_boundary(0, 1, 61.0).unwrap();
    assert_eq!(due.save.as_deref(), Some("r1.it-000000.step-000000001"));
    assert!(!due.wait && due.exit.is_none() && !due.prepare);
    s.saved(0.01, 61.5);
    assert_eq!(s.step_boundary(0, 2, 100.0).unwrap().save, None);
    assert!(s.step_boundary(0, 3, 122.0).unwrap().save.is_some());
}

#[test]
fn retention_is_applied_after_a_saved_block_and_at_completion_and_a_failed_break_discards() {
    let mut s = session(Shape {
        outer: 3,
        steps: Some(1),
        every: Some(2),
    });
    // No retention chosen: a loop of unknown length keeps a bounded spread.
    s.outer_start("it", None);
    assert_eq!(
        s.retention().keep_spread,
        Some(crate::checkpoint::retention::DEFAULT_SPREAD)
    );
    let mut s = session(Shape {
        outer: 3,
        steps: Some(1),
        every: Some(2),
    });
    s.outer_start("epoch", Some(3));
    assert!(
        s.retention().is_empty(),
        "an epoch loop keeps every checkpoint"
    );
    s.set_retention(
        crate::checkpoint::retention::Retention {
            keep_last: Some(1),
            ..Default::default()
        },
        None,
    );
    s.iteration_start(0);
    s.block_start(0);
    let saved = s.block_end(0, 1.0, None, None, 0.0).unwrap().unwrap();
    assert_eq!(
        (saved.name.as_str(), saved.wait),
        ("r1.epoch-000000", false)
    );
    let end = s.iteration_end(0, false).unwrap();
    assert_eq!(end.checkpoint.as_deref(), Some("r1.epoch-000000"));
    assert!(end.apply_retention && end.save.is_none() && end.exit.is_none());
    s.iteration_start(1);
    s.block_start(1);
    assert_eq!(s.block_end(1, 1.0, None, None, 0.0).unwrap(), None);
    assert_eq!(s.iteration_end(1, false).unwrap(), IterationEnd::default());
    // Iteration 2's steps are left early: kept only if the iteration goes on.
    s.iteration_start(2);
    s.block_start(2);
    assert!(s.block_end(2, 1.0, None, None, 0.0).unwrap().is_some());
    s.block_closed(2);
    let mut failed = s.clone();
    assert_eq!(
        failed.finish(Status::Failed).discard.as_deref(),
        Some("r1.epoch-000002")
    );
    s.iteration_continues();
    let done = s.finish(Status::Completed);
    assert_eq!(
        done,
        Finish {
            discard: None,
            apply_retention: true
        }
    );
}

fn plan(modes: &[(u64, Mode)]) -> WorkerPlan {
    let modes: BTreeMap<u64, Mode> = modes.iter().copied().collect();
    let checkpoints = modes
        .iter()
        .filter(|(_, m)| **m == Mode::Restore)
        .map(|(i, _)| (*i, format!("r1.epoch-{i:06}")))
        .collect();
    WorkerPlan {
        run_id: "r1".into(),
        worker: 0,
        loop_name: "epoch".into(),
        modes,
        checkpoints,
        progress_fd: None,
        log_db: None,
        replay_id: None,
        state_checks: BTreeMap::new(),
        exact: true,
        seconds: BTreeMap::new(),
        restore_seconds: None,
    }
}

#[test]
fn a_replay_visits_what_its_plan_names_and_stops_after_the_last() {
    use Mode::{Execute as E, Restore as R};
    type Case<'a> = (&'a [(u64, Mode)], &'a [Visit]);
    let cases: &[Case<'_>] = &[
        (
            &[(0, E), (1, E)],
            &[Visit::RunFromStart, Visit::Run, Visit::Stop],
        ),
        (
            &[(2, R), (3, E)],
            &[
                Visit::Skip,
                Visit::Skip,
                Visit::RunStale,
                Visit::Run,
                Visit::Stop,
            ],
        ),
        (
            &[(0, R), (2, R)],
            &[Visit::Run, Visit::Skip, Visit::RunStale, Visit::Stop],
        ),
        (&[], &[Visit::Stop]),
    ];
    for (modes, want) in cases {
        let mut s = ReplaySession::new(plan(modes));
        s.outer_start("epoch");
        let got: Vec<Visit> = (0..want.len() as u64)
            .map(|i| s.iteration_start(i).unwrap())
            .collect();
        assert_eq!(&got, want, "{modes:?}");
        assert!(s.past_plan());
    }
    // A plan that executes an iteration without visiting the one before is a bug.
    let mut s = ReplaySession::new(plan(&[(0, E), (2, E)]));
    s.iteration_start(0).unwrap();
    s.iteration_start(1).unwrap();
    assert_eq!(
        s.iteration_start(2).unwrap_err().kind(),
        crate::error::ErrorKind::Internal
    );
}

#[test]
fn one_step_iterations_are_checked_now_and_then_instead_of_restored() {
    use Mode::{Execute as E, Restore as R};
    // A partial replay of a loop of one-step iterations (an outer probe in
    // the body): 0 executed, then every iteration checkpointed, 10 ms of
    // compute each.
    let mut modes = vec![(0, E)];
    modes.extend((1..=40).map(|i| (i, R)));
    let mut p = plan(&modes);
    for i in 1..=40 {
        p.seconds.insert(i, 0.01);
    }
    let ends = |p: WorkerPlan, check_secs: Option<f64>| {
        let mut s = ReplaySession::new(p);
        s.outer_start("epoch");
        let mut out = Vec::new();
        for i in 0..=40 {
            s.iteration_start(i).unwrap();
            let end = s.block_end(i, true).unwrap();
            if let (BlockEnd::Check { .. }, Some(c)) = (&end, check_secs) {
                s.checked(c);
            }
            out.push(end);
        }
        (out, s.restored_count())
    };
    let checks = |v: &[BlockEnd]| {
        v.iter()
            .enumerate()
            .filter(|(_, e)| matches!(e, BlockEnd::Check { .. }))
            .map(|(i, _)| i as u64)
            .collect::<Vec<_>>()
    };
    // A check costs 10 ms: one per 200 ms of compute (20 iterations), the
    // first to measure it, and the last checkpoint.
    let (got, restored) = ends(p.clone(), Some(0.01));
    assert_eq!(checks(&got), vec![1, 21, 40]);
    assert_eq!(restored, 0);
    assert!(got.iter().all(|e| !matches!(e, BlockEnd::Restore { .. })));
    // Not exact (another thread count): every checkpoint is put back.
    let mut inexact = p.clone();
    inexact.exact = false;
    let (got, _) = ends(inexact, None);
    assert!(got[1..]
        .iter()
        .all(|e| matches!(e, BlockEnd::Restore { .. })));
    // An iteration whose predecessor was not visited is put back too.
    let mut s = ReplaySession::new(plan(&[(3, R), (4, R)]));
    s.outer_start("epoch");
    for i in 0..3 {
        s.iteration_start(i).unwrap();
    }
    s.iteration_start(3).unwrap();
    assert!(matches!(
        s.block_end(3, true).unwrap(),
        BlockEnd::Restore { .. }
    ));
}

#[test]
fn executed_one_step_iterations_are_compared_sparsely_and_inner_loops_at_every_checkpoint() {
    use Mode::Execute as E;
    // A parallel replay's worker executing one-step iterations 0..=40, each
    // checkpointed by the recording, 10 ms of compute each.
    let mut p = plan(&(0..=40).map(|i| (i, E)).collect::<Vec<_>>());
    for i in 0..=40 {
        p.state_checks.insert(i, format!("r1.epoch-{i:06}"));
        p.seconds.insert(i, 0.01);
    }
    let checked = |at_iteration: bool| {
        let mut s = ReplaySession::new(p.clone());
        s.outer_start("epoch");
        let mut out = Vec::new();
        for i in 0..=40 {
            s.iteration_start(i).unwrap();
            if !at_iteration {
                s.block_start(i, BTreeMap::new()).unwrap();
            }
            if let BlockEnd::Check { checkpoint } = s.block_end(i, at_iteration).unwrap() {
                assert_eq!(checkpoint, format!("r1.epoch-{i:06}"));
                s.checked(0.01);
                out.push(i);
            }
            s.iteration_end(i);
        }
        // The end line counts the bodies of iterations without an inner loop.
        let bodies = if at_iteration { 41 } else { 0 };
        assert!(s
            .summary(1.0)
            .starts_with(&format!("steps 0 bodies {bodies} ")));
        out
    };
    // One check per 200 ms of compute at 10 ms a check, and the last.
    assert_eq!(checked(true), vec![0, 20, 40]);
    // With an inner loop, every checkpointed iteration is compared.
    assert_eq!(checked(false), (0..=40).collect::<Vec<_>>());
}

#[test]
fn a_replay_restores_or_executes_instead_by_cost_and_checks_what_it_executed() {
    use Mode::{Execute as E, Restore as R};
    let mut p = plan(&[(0, E), (1, R), (2, R)]);
    p.state_checks.insert(0, "r1.epoch-000000".into());
    p.seconds.insert(1, 0.5);
    p.seconds.insert(2, 0.5);
    let mut unchecked = ReplaySession::new(p.clone());
    let mut s = ReplaySession::new(p);
    s.outer_start("epoch");
    s.iteration_start(0).unwrap();
    assert_eq!(s.block_start(0, BTreeMap::new()).unwrap(), BlockStart::Run);
    assert_eq!(
        s.block_end(0, false).unwrap(),
        BlockEnd::Check {
            checkpoint: "r1.epoch-000000".into()
        }
    );
    assert_eq!(s.iteration_end(0), "0\n");
    // Restore cost unknown: restore, and measure it.
    s.iteration_start(1).unwrap();
    assert_eq!(
        s.block_start(1, BTreeMap::new()).unwrap(),
        BlockStart::Restore {
            checkpoint: "r1.epoch-000001".into()
        }
    );
    s.restored(2.0);
    assert_eq!(s.block_end(1, false).unwrap(), BlockEnd::Nothing);
    // Restoring costs 2 s, the iteration 0.5 s: executed, then checked against the checkpoint it replaces.
    s.iteration_start(2).unwrap();
    assert_eq!(s.block_start(2, BTreeMap::new()).unwrap(), BlockStart::Run);
    assert_eq!(
        s.block_end(2, false).unwrap(),
        BlockEnd::Check {
            checkpoint: "r1.epoch-000002".into()
        }
    );
    assert_eq!(
        s.summary(3.0),
        "steps 0 bodies 0 restored 1 restore_s 2.000000 run_s 3.000000\n"
    );
    // A front end that cannot check an executed state keeps the plan's restores.
    unchecked.set_cost_rule(false);
    for i in 0..2 {
        unchecked.iteration_start(i).unwrap();
        unchecked.block_start(i, BTreeMap::new()).unwrap();
    }
    unchecked.restored(2.0);
    unchecked.iteration_start(2).unwrap();
    let block = unchecked.block_start(2, BTreeMap::new()).unwrap();
    assert_eq!(
        block,
        BlockStart::Restore {
            checkpoint: "r1.epoch-000002".into()
        }
    );
}

#[test]
fn a_replay_stops_at_the_first_batch_the_recording_did_not_consume() {
    let mut s = ReplaySession::new(plan(&[(0, Mode::Execute)]));
    s.outer_start("epoch");
    s.iteration_start(0).unwrap();
    let expected = [(0, "aa".to_string()), (1, "bb".to_string())]
        .into_iter()
        .collect();
    s.block_start(0, expected).unwrap();
    s.step(0, 0, "aa").unwrap();
    let e = s.step(0, 1, "cc").unwrap_err();
    assert_eq!(e.kind(), crate::error::ErrorKind::Diverged);
    assert!(
        e.to_string().starts_with(
            "replay of run r1 diverged from the recording: the batch at epoch 0, step 1"
        ),
        "{e}"
    );
    s.step(0, 2, "dd").unwrap(); // not recorded (a longer epoch now): not compared
    assert_eq!(s.steps_executed(), 3);
}

#[test]
fn a_resumed_batch_must_be_the_recorded_one() {
    let mut s = session(Shape {
        outer: 1,
        steps: Some(2),
        every: None,
    });
    s.outer_start("epoch", Some(1));
    s.resumed_batch(0, 0, None, Some("aa"), "aa").unwrap();
    s.resumed_batch(0, 1, None, None, "zz").unwrap();
    let e = s.resumed_batch(0, 1, None, Some("aa"), "zz").unwrap_err();
    assert!(
        e.to_string()
            .contains("the batch at epoch 0, step 1 differs from the recorded one"),
        "{e}"
    );
    // A job's ranks each consume their own batches: the error names whose.
    let e = s
        .resumed_batch(0, 1, Some(1), Some("aa"), "zz")
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("rank 1's batch at epoch 0, step 1 differs"),
        "{e}"
    );
}

#[test]
fn a_framework_saves_on_its_own_periods_and_a_signal_at_its_epoch_end_saves_the_epoch() {
    let mut s = session(Shape {
        outer: 4,
        steps: Some(4),
        every: None,
    });
    // Lightning: every 2nd epoch counted from one, every 3rd global step after the resumed step 2.
    s.set_framework_periods(Some(2), Some(3), 2).unwrap();
    s.outer_start("epoch", Some(4));
    let mut saves = Vec::new();
    let mut step = 0;
    for i in 0..2 {
        s.iteration_start(i);
        s.block_start(i);
        for _ in 0..4 {
            step += 1;
            if let Some(name) = s.step_boundary(i, step, 0.0).unwrap().save {
                saves.push(name);
            }
        }
        if let Some(b) = s.block_end(i, 1.0, None, None, 0.0).unwrap() {
            assert!(!b.wait);
            saves.push(b.name);
        }
        assert_eq!(s.iteration_end(i, false).unwrap().exit, None);
    }
    let want = [
        "r1.epoch-000000.step-000000003",
        "r1.epoch-000001.step-000000006",
        "r1.epoch-000001",
    ];
    assert_eq!(saves, want);
    // A signal after the steps: the epoch's checkpoint is saved (and waited
    // for), off its period, and the process leaves at the epoch's end.
    s.iteration_start(2);
    s.block_start(2);
    s.signal(15);
    let b = s.block_end(2, 1.0, None, None, 0.0).unwrap().unwrap();
    assert_eq!((b.name.as_str(), b.wait), ("r1.epoch-000002", true));
    let end = s.iteration_end(2, false).unwrap();
    assert_eq!((end.save, end.exit), (None, Some(85)));
    assert!(s.set_framework_periods(Some(0), None, 0).is_err());
}

#[test]
fn a_recording_says_what_it_checkpoints_why_and_what_it_cost() {
    let mut s = session(Shape {
        outer: 2,
        steps: Some(1),
        every: Some(2),
    });
    s.outer_start("epoch", Some(2));
    let objects = ["model".to_string(), "RNG states".to_string()];
    assert_eq!(
        s.start_line("train.py", "/p/.hindsight", &objects, false),
        "hindsight: recording run r1 of train.py in /p/.hindsight; checkpoints of model, RNG states; \
         every 2 iterations of the outer loop"
    );
    assert!(s
        .start_line("train.py", "/p/.hindsight", &[], false)
        .ends_with("nothing is checkpointed (no hs.checkpointing)"));
    // One decision per block end, said once.
    s.iteration_start(0);
    s.block_start(0);
    assert!(s.block_end(0, 1.0, None, None, 0.0).unwrap().is_some());
    assert_eq!(
        s.take_decision().as_deref(),
        Some("epoch 0: checkpoint (every 2)")
    );
    assert_eq!(s.take_decision(), None);
    s.saved(0.25, 1.0);
    s.iteration_end(0, false).unwrap();
    s.iteration_start(1);
    s.block_start(1);
    assert!(s.block_end(1, 1.0, None, None, 0.0).unwrap().is_none());
    assert_eq!(
        s.take_decision().as_deref(),
        Some("epoch 1: no checkpoint (every 2)")
    );
    s.signal(15);
    s.iteration_end(1, false).unwrap();
    let line = s.summary(Status::Completed, "train.py", Some(3 << 20), 10.0);
    assert_eq!(
        line,
        "hindsight: run r1 completed after 10.0 s: 1 checkpoint (3.0 MiB written), 250 ms of training \
         time in them (2.5%). Add hs.log(...) lines and replay: hindsight replay train.py"
    );
    let line = s.summary(Status::Interrupted, "train.py", None, 10.0);
    assert!(
        line.ends_with("(2.5%). Run the same command again to resume"),
        "{line}"
    );

    // Adaptive: the bound and the measured cost are named.
    let mut a = RecordSession::new(
        "r2",
        CheckpointSchedule::new(None, 0.05).unwrap(),
        85,
        None,
        0.0,
    );
    a.set_objects(true);
    a.outer_start("epoch", None);
    assert!(a
        .start_line("t.py", "h", &objects, false)
        .ends_with("adaptive: taken while the recording costs under 5.0% of the compute; HINDSIGHT_CHECKPOINT_EVERY=N: every N iterations"));
    a.iteration_start(0);
    a.block_start(0);
    a.block_end(0, 10.0, None, None, 0.1).unwrap();
    let d = a.take_decision().unwrap();
    assert!(d.starts_with("epoch 0: checkpoint (adaptive: recording costs 1.0% of the compute so far (checkpoints 1.0%, hooks 0.0%, charged 0.0% with the body's time they cost), bound 5.0%;"), "{d}");
    a.saved(0.1, 10.0);
    a.iteration_end(0, false).unwrap();
    // A restore was measured dearer than an iteration's compute (a slow
    // store): the next checkpoint waits until it skips more than that.
    a.restore_measured(15.0);
    let mut taken = vec![];
    for i in 1..5 {
        a.iteration_start(i);
        a.block_start(i);
        let save = a.block_end(i, 10.0, None, None, 0.1).unwrap();
        let d = a.take_decision().unwrap();
        if save.is_some() {
            a.saved(0.1, 10.0);
        } else {
            assert!(d.contains("a restore costs 15.000 s, more than the"), "{d}");
        }
        taken.push(save.is_some());
        a.iteration_end(i, false).unwrap();
    }
    assert_eq!(taken, [false, true, false, true]);
    let line = a.summary(Status::Completed, "t.py", None, 60.0);
    assert!(
        line.contains("3 checkpoints") && line.contains("; 2 more fit the overhead bound but were not taken: restoring one (15000 ms) costs more than the compute since the one before"),
        "{line}"
    );
    // A front end that does not time its hooks gets no claim about them.
    assert!(!line.contains("own CPU"), "{line}");
    // One that does: everything the recording cost, against 50 s of compute
    // (its start-up too).
    a.overhead(0.5);
    a.started(0.25);
    let line = a.summary(Status::Completed, "t.py", None, 60.0);
    let own = line
        .split("; the recording's own CPU was ")
        .nth(1)
        .unwrap_or_else(|| panic!("{line}"));
    let checkpoints = 100.0 * a.schedule().policy().checkpoint_share();
    assert!(
        own.starts_with(&format!(
            "{:.1}% of the compute (start-up 0.5%, checkpoints {checkpoints:.1}%, loop hooks 1.0%)",
            checkpoints + 1.5
        )),
        "{line}"
    );
    // No writer CPU went uncharged here: no idle-core clause.
    assert!(!line.contains("left idle"), "{line}");
}

/// Two ranks of one job: the follower joins rank 0's run and takes its
/// block decisions, so both name and save the same checkpoints; a signal
/// only one rank saw, once agreed, stops both at the same step.
#[test]
fn a_following_rank_saves_what_rank_0_decides_under_the_same_names() {
    let adaptive = || {
        let mut s = RecordSession::new(
            "",
            CheckpointSchedule::new(None, 0.1).unwrap(),
            85,
            Some(60.0),
            5.0,
        );
        s.set_objects(true);
        s
    };
    let (mut lead, mut follow) = (adaptive(), adaptive());
    lead.join("job", 100.0);
    follow.join("job", 100.0);
    for s in [&mut lead, &mut follow] {
        s.outer_start("epoch", Some(3));
        assert_eq!(s.iteration_start(0), Visit::Run);
        assert_eq!(s.block_start(0), BlockStart::Run);
    }
    // Only rank 0 measures; its decision reaches the other rank.
    let decided = lead.block_end(0, 10.0, None, None, 0.0).unwrap();
    let followed = follow.block_end_decided(0, decided.is_some()).unwrap();
    assert_eq!(decided, followed);
    assert_eq!(
        followed.map(|b| b.name),
        Some("job.epoch-000000".to_string())
    );
    assert_eq!(follow.block_end_decided(0, false).unwrap(), None);
    // The safety timer counts from the agreed clock on both ranks.
    for s in [&mut lead, &mut follow] {
        s.iteration_end(0, false).unwrap();
        s.iteration_start(1);
        s.block_start(1);
        assert_eq!(s.step_boundary(1, 0, 150.0).unwrap().save, None);
        s.signal(10); // agreed: one rank got it, both hear it
        let act = s.step_boundary(1, 1, 151.0).unwrap();
        assert_eq!(act.save.as_deref(), Some("job.epoch-000001.step-000000001"));
        assert_eq!((act.wait, act.exit), (true, Some(85)));
    }
}

#[test]
fn checkpoints_outgrowing_the_budget_are_thinned_to_a_spread() {
    let mut s = RecordSession::new(
        "r1",
        CheckpointSchedule::new(Some(1), 0.1).unwrap(),
        85,
        None,
        0.0,
    );
    s.set_budget(Some(100 << 20));
    s.set_objects(true);
    s.outer_start("epoch", Some(100));
    let mut spread = Vec::new();
    for i in 0..40 {
        s.saved(0.01, i as f64);
        s.checkpoint_size(5 << 20);
        spread.push(s.retention().keep_spread);
    }
    // 20 checkpoints of 5 MiB fit in 100 MiB: kept whole until then ...
    assert!(spread[..20].iter().all(Option::is_none), "{spread:?}");
    // ... then thinned to a spread of as many as fit.
    assert_eq!(spread[20], Some(20));
    // Huge checkpoints: never fewer than MIN_KEPT_IN_BUDGET.
    s.checkpoint_size(1 << 30);
    assert_eq!(s.retention().keep_spread, Some(MIN_KEPT_IN_BUDGET));
    // A chosen retention replaces the budget.
    let mut chosen = s.clone();
    chosen.set_retention(
        Retention {
            keep_last: Some(3),
            ..Retention::default()
        },
        None,
    );
    chosen.checkpoint_size(1 << 30);
    assert_eq!(chosen.retention().keep_spread, None);
}

/// An iteration whose thread shared its core with two busy threads: the
/// policy's compute is the time it ran, not the time it waited for the
/// core, so the recording is not allowed ε of the others' work.
#[test]
fn the_policy_counts_the_trainings_time_not_its_wait_for_a_cpu() {
    if crate::runs::cpu::RunQueue::default()
        .waited_secs()
        .is_none()
    {
        return; // a kernel without schedstats: nothing to measure
    }
    let (wall, compute) = crate::runs::cpu::on_a_crowded_core(|| {
        let mut s = RecordSession::new(
            "run",
            CheckpointSchedule::new(None, 0.1).unwrap(),
            85,
            None,
            0.0,
        );
        s.measure_run_queue();
        s.set_objects(true);
        s.outer_start("epoch", Some(1));
        s.iteration_start(0);
        s.block_start(0);
        let t0 = std::time::Instant::now();
        while t0.elapsed().as_secs_f64() < 0.3 {
            std::hint::spin_loop();
        }
        let wall = t0.elapsed().as_secs_f64();
        s.block_end(0, wall, None, None, 0.001).unwrap();
        (wall, s.schedule().policy().total_compute_secs)
    });
    // It ran about a third of the 0.3 s.
    assert!(
        compute > 0.0 && compute < 0.7 * wall,
        "{compute} of {wall} s"
    );
}
