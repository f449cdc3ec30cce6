use std::time::Instant;
#[tokio::main]
async fn main() {
    let url = std::env::args().nth(1).unwrap();
    let store = aether_ledger::EventStore::connect(&url, Default::default())
        .await
        .unwrap();
    for _ in 0..3 {
        let t = Instant::now();
        let p = aether_control::PolicyRegistry::load(store.clone())
            .await
            .unwrap();
        let tp = t.elapsed();
        let t = Instant::now();
        let m = aether_control::ModelRegistry::load(store.clone())
            .await
            .unwrap();
        let tm = t.elapsed();
        let t = Instant::now();
        let _c = aether_control::CorpusRegistry::load(store.clone())
            .await
            .unwrap();
        let tc = t.elapsed();
        let t = Instant::now();
        let _e = aether_control::EngineRegistry::load(store.clone(), m.clone(), p.clone())
            .await
            .unwrap();
        let te = t.elapsed();
        let t = Instant::now();
        let _r = aether_control::RolloutRegistry::load(store.clone(), m.clone())
            .await
            .unwrap();
        let tr = t.elapsed();
        let t = Instant::now();
        let s = aether_control::ControlState::replay(&store).await.unwrap();
        let all = t.elapsed();
        let t = Instant::now();
        let d = s.digest();
        let td = t.elapsed();
        println!(
            "policies {tp:?} models {tm:?} corpora {tc:?} engines {te:?} rollouts {tr:?} | all {all:?} digest {td:?} {}",
            &d[..8]
        );
    }
}
