-- Personal values committed to by events (salted SM3 commitments in the payload). Rows can
-- be deleted (redaction: a RedactionApplied event records it) but never changed.
CREATE TABLE personal_data (
    event_id UUID  NOT NULL REFERENCES events (event_id),
    member   TEXT  NOT NULL,
    value    TEXT  NOT NULL, -- RFC 8785 text of the value
    salt     BYTEA NOT NULL CHECK (octet_length(salt) = 16),
    PRIMARY KEY (event_id, member)
);

CREATE FUNCTION aether_personal_data_no_update() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'personal data can be redacted (deleted), never changed'
        USING ERRCODE = 'insufficient_privilege';
END;
$$;

CREATE TRIGGER personal_data_no_update
    BEFORE UPDATE ON personal_data
    FOR EACH ROW EXECUTE FUNCTION aether_personal_data_no_update();
