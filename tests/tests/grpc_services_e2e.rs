//! What the clearing port says it serves: gRPC reflection (v1 and v1alpha) lists exactly
//! the services it answers, and health reports each of them, over the port's mTLS.

use aether_e2e::Server;
use aether_gateway::certs::PkiLayout;
use aether_gateway::identity::Role;
use aether_gateway::tls::{TlsPaths, client_tls_config};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const SERVED: [&str; 5] = [
    "aether.v1.ClearingService",
    "aether.v1.WorkerService",
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
];

async fn channel(server: &Server, data: &std::path::Path) -> tonic::transport::Channel {
    let tls = client_tls_config(&TlsPaths::client(
        &PkiLayout::new(data),
        Role::Member,
        "bank-a",
    ))
    .unwrap();
    tonic::transport::Endpoint::from_shared(server.grpc_url.clone())
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_and_health_name_exactly_what_the_port_serves() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[]);
    let channel = channel(&server, &data).await;

    // Reflection v1.
    {
        use tonic_reflection::pb::v1::ServerReflectionRequest;
        use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut answers = ServerReflectionClient::new(channel.clone())
            .server_reflection_info(futures::stream::iter(vec![request]))
            .await
            .unwrap()
            .into_inner();
        let Some(MessageResponse::ListServicesResponse(list)) =
            answers.message().await.unwrap().unwrap().message_response
        else {
            panic!("no service list");
        };
        let mut names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
        names.sort();
        assert_eq!(names, SERVED);
    }
    // Reflection v1alpha, as older tools ask.
    {
        use tonic_reflection::pb::v1alpha::ServerReflectionRequest;
        use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse;
        let requests = vec![
            ServerReflectionRequest {
                host: String::new(),
                message_request: Some(MessageRequest::ListServices(String::new())),
            },
            ServerReflectionRequest {
                host: String::new(),
                message_request: Some(MessageRequest::FileContainingSymbol(
                    "aether.v1.ClearingService".into(),
                )),
            },
        ];
        let mut answers = ServerReflectionClient::new(channel.clone())
            .server_reflection_info(futures::stream::iter(requests))
            .await
            .unwrap()
            .into_inner();
        let Some(MessageResponse::ListServicesResponse(list)) =
            answers.message().await.unwrap().unwrap().message_response
        else {
            panic!("no service list");
        };
        let mut names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
        names.sort();
        assert_eq!(names, SERVED);
        let Some(MessageResponse::FileDescriptorResponse(files)) =
            answers.message().await.unwrap().unwrap().message_response
        else {
            panic!("no descriptor for ClearingService");
        };
        assert!(!files.file_descriptor_proto.is_empty());
    }
    // Health: every served service and the server as a whole; nothing else.
    let mut health = HealthClient::new(channel);
    for service in ["", "aether.v1.ClearingService", "aether.v1.WorkerService"] {
        let answer = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(answer.status, ServingStatus::Serving as i32, "{service:?}");
    }
    let status = health
        .check(HealthCheckRequest {
            service: "aether.v1.SnapshotParticipant".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::NotFound);
    let log_path = server.log_path.clone();
    let stopped = server.terminate();
    assert!(
        stopped.success(),
        "{stopped}: {}",
        std::fs::read_to_string(log_path).unwrap_or_default()
    );
}
