//! The status page's handlers with `oneshot`, over workers joined to the registry by hand (the
//! fakes' join: nothing serves behind them, the page reads the registry only).

use crate::fake;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use fake::{join_at, state_on};
use http_body_util::BodyExt;
use proto::Pool;
use router::planner::{Action, Decision, Inputs};
use router::State;
use serde_json::Value;
use tower::ServiceExt;

async fn get(st: &Arc<State>, uri: &str) -> (StatusCode, String, String) {
    let req = Request::builder().uri(uri).body(Body::empty()).unwrap();
    let resp = router::operator(st.clone()).oneshot(req).await.unwrap();
    let status = resp.status();
    let kind = resp
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, kind, String::from_utf8_lossy(&bytes).into_owned())
}

fn with_keys() -> Arc<State> {
    let keys: std::collections::HashSet<String> = ["sk-good".to_string()].into();
    state_on(Default::default(), Duration::from_secs(5), |s| {
        s.limits.api_keys = Some(Arc::new(keys));
        s.board = router::status::Board::new(router::status::Targets {
            ttft_p90: Some(Duration::from_millis(800)),
            itl_p90: Some(Duration::from_millis(60)),
        });
    })
}

#[tokio::test]
async fn the_page_is_one_html_file_on_the_operators_listener() {
    let st = with_keys();
    for path in ["/", "/status"] {
        let (code, kind, body) = get(&st, path).await;
        assert_eq!(code, StatusCode::OK, "{path}");
        assert!(kind.starts_with("text/html"), "{path}: {kind}");
        // Self-contained: it fetches only its own JSON, nothing from elsewhere.
        assert!(body.contains("fetch(\"status.json\""), "{path}");
        assert!(
            !body.contains("http://") && !body.contains("https://"),
            "{path}"
        );
    }
    // The operator's listener serves no API.
    let (code, _, _) = get(&st, "/v1/models").await;
    assert_eq!(code, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn status_json_shows_every_worker_its_targets_and_the_planners_decisions() {
    let st = with_keys();
    join_at(&st, Pool::Prefill, "http://127.0.0.1:9");
    join_at(&st, Pool::Decode, "http://127.0.0.1:10");
    let now = Instant::now();
    st.signals
        .itl
        .lock()
        .unwrap()
        .record(now, Duration::from_millis(40));
    st.signals
        .ttft
        .lock()
        .unwrap()
        .record(now, Duration::from_millis(300));
    let inputs = Inputs {
        live: 1,
        p90: Some(Duration::from_millis(90)),
        queued: 3,
        needed: Some(2.4),
        censored: true,
        growth: 0.1,
        ..Default::default()
    };
    let up = Decision {
        desired: 2,
        action: router::planner::Action::Up,
        why: "p90 90 ms over target 60 ms".into(),
        needed_ahead: Some(3),
    };
    st.board.decided(now, Pool::Decode, &inputs, &up);
    st.board.sample(&st);

    let (code, kind, body) = get(&st, "/status.json").await;
    assert_eq!(code, StatusCode::OK);
    assert!(kind.starts_with("application/json"), "{kind}");
    let s: Value = serde_json::from_str(&body).unwrap();
    let ws = s["workers"].as_array().unwrap();
    assert_eq!(ws.len(), 2, "{s}");
    for w in ws {
        assert_eq!(w["device"], "mock", "{w}");
        assert_eq!(w["health"], "ok", "{w}");
        assert_eq!(w["kv_blocks"]["total"], 64, "{w}");
        assert_eq!(w["kv_blocks"]["free"], 64, "{w}");
    }
    assert_eq!(s["pools"]["prefill"]["workers"], 1);
    assert_eq!(s["pools"]["decode"]["target_p90_ms"], 60.0);
    assert_eq!(s["latency"]["ttft"]["target_p90_ms"], 800.0);
    let itl_p90 = s["latency"]["itl"]["p90_ms"].as_f64().unwrap();
    assert!((39.0..=41.0).contains(&itl_p90), "{itl_p90}");
    let d = &s["planner"]["decisions"][0];
    assert_eq!(d["action"], Action::Up.label());
    assert_eq!(d["desired"], 2);
    assert_eq!(d["queued"], 3);
    assert_eq!(d["p90_ms"], 90.0);
    // The demand's need, observed (a fraction) and predicted a start-up ahead.
    assert_eq!(
        (d["needed"].as_f64(), d["needed_ahead"].as_u64()),
        (Some(2.4), Some(3))
    );
    // Some of the demand waited: the need is a floor (the page shows "≥").
    assert_eq!(d["needed_censored"], true);
    assert_eq!(d["growth_per_s"], 0.1);
    let h = s["history"].as_array().unwrap();
    assert_eq!(h.len(), 1);
    assert_eq!(h[0]["decode_workers"], 1);
    // A hold is the pool's latest decision, not one of the listed changes.
    let hold = Decision {
        desired: 2,
        action: router::planner::Action::Hold,
        why: "within target".into(),
        needed_ahead: None,
    };
    st.board
        .decided(Instant::now(), Pool::Decode, &inputs, &hold);
    let (_, _, body) = get(&st, "/status.json").await;
    let s: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(s["planner"]["decisions"].as_array().unwrap().len(), 1);
    assert_eq!(
        s["planner"]["latest"]["decode"]["action"],
        Action::Hold.label()
    );
}
